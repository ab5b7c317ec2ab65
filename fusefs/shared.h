/* shared.h — constants more than one layer of the daemon names. */
#ifndef HAPI_FUSEFS_SHARED_H
#define HAPI_FUSEFS_SHARED_H

/*
 * What a storage mount shows that a remote mount reads back (the pack's
 * names and format, the bound on a control file's size), and the states
 * and modes more than one layer reports. Constants only.
 */
#define HAPI_PACK_NAME ".hapifs-pack.npy"
#define HAPI_PACK_INDEX_NAME ".hapifs-pack.json"
#define HAPI_PACK_FORMAT "hapifs-pack/1"

/* The size a control file shows: its content (made at open) is never longer. */
#define HAPI_CTL_SIZE_MAX (4u << 20)

enum hapi_warm_state {
    HAPI_WARM_IDLE, HAPI_WARM_COUNTING, HAPI_WARM_RUNNING, HAPI_WARM_DONE,
    HAPI_WARM_STOPPED       /* by hapi_warm_stop() or hapi_remote_warm_stop() */
};

enum hapi_prefetch_mode { HAPI_PREFETCH_OFF = 0, HAPI_PREFETCH_DIR = 1 };

#endif
