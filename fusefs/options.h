/* options.h — the command line, parsed and validated. */
#ifndef HAPI_FUSEFS_OPTIONS_H
#define HAPI_FUSEFS_OPTIONS_H

#include <stdint.h>
#include <sys/types.h>
#include <fuse_opt.h> /* struct fuse_args: option parsing only, no FUSE session */

#include "hapi.h"

/* Everything the command line says, validated. Strings are owned (malloc). */
/* precision=auto: a value of hapi_fs_options.precision beside enum hapi_precision's, never
   given to the extractor (policy.h, hapi_precision_choose()). */
#define HAPI_PRECISION_AUTO 3

typedef struct hapi_fs_options {
    char *source;          /* absolute, resolved */
    char *mountpoint;      /* absolute, resolved */
    char *model;           /* absolute, resolved */
    char *split;           /* "auto", N or NAME */
    char *freeze;          /* NULL = the model's default */
    char *cache_dir;       /* absolute */
    char *log_path;        /* NULL = stderr in the foreground, syslog otherwise */
    char *device;          /* "cpu" or "cuda[:N]" */
    int dtype;             /* enum hapi_dtype */
    int mode;              /* enum hapi_preprocess_mode */
    int precision;         /* enum hapi_precision, or HAPI_PRECISION_AUTO until the mount
                              has chosen (hapi_fs_init() sets the one chosen) */
    uint64_t max_pixels;
    uint64_t cache_size;   /* bytes */
    int cache_reset;       /* replace a corrupt or foreign cache store */
    int threads;           /* FUSE worker threads (max) */
    int torch_threads;     /* libtorch intra-op threads */
    int batch;             /* storage-side batch; 0 = auto (the policy's) */
    int batch_wait_us;     /* how long a partial batch waits for more demand */
    int decode_threads;
    int inference_workers; /* inference threads, each with torch_threads / N threads */
    uint64_t mem_budget;   /* bytes of in-flight images and tensors */
    char *node_path;       /* the node file shared with the node's other mounts; NULL: none */
    int node_required;     /* node options were given: failing to join fails the mount */
    uint64_t node_mem;     /* node_mem=: the node's budget (0: keep the file's) */
    int node_cores;        /* node_cores=: the node's core tokens (0: keep the file's) */
    int warm;              /* warm the whole tree at mount */
    int prefetch;          /* enum hapi_prefetch_mode */
    double link_bps;       /* the link to the compute tier, bits/s */
    double link_bytes;     /* the most a split's .feat may put on it, in source images' bytes
                              (-1: link_bytes=any, no bound) */
    double rtt_s;          /* its round-trip time, seconds (0: not counted) */
    int transport;         /* enum hapi_policy_transport: how the compute tier reads */
    double client_speed;   /* the compute tier's speed relative to this node */
    double compute_file_ms; /* its training loop's CPU per file beside the stages, measured
                              there (< 0: not given, HAPI_POLICY_COMPUTE_FILE_MS) */
    int epochs;            /* epochs a job is expected to read */
    int profile_redo;      /* measure the model even if a profile is stored */
    int show_raw;
    int watch;             /* watch the source with inotify (watch.c) */
    int no_open;           /* let the kernel skip opens (with watch, on a storage mount) */
    int uring;             /* serve through io_uring where the kernel offers it */
    int foreground;
    int debug;
    int fake;              /* mount helper called with -f: do nothing */
    int show_help;
    int show_version;
    int remote;            /* -o remote: a compute-side mount over storage mounts */
    char **roots;          /* remote: the SOURCE directories (source split at ':'), resolved */
    size_t nroots;
    int refresh_ms;        /* remote: how long a directory's index is trusted */
    int fetch_threads;     /* remote: packs fetched at once */
    int finish;            /* remote, features=freeze (the default): run [split, freeze) here */
    gid_t ctl_gid;         /* ctl_group=: its members may write .hapifs/ctl; -1: none */
    int serving_gate;      /* not an option: the daemon says when it serves (hapi_fs_serving) */
    int dead_mount;        /* not an option: mountpoint is our mount whose daemon died */
    struct fuse_args fuse_args; /* what goes to fuse_session_new() */
} hapi_fs_options;

/*
 * Parses and validates argv (hapifs SOURCE MOUNTPOINT [-o opts] [-f] [-d], or
 * the mount helper's SOURCE MOUNTPOINT [-sfnv] [-o opts]; helper is nonzero
 * when called as mount.hapifs). Checks that SOURCE and MOUNTPOINT are
 * directories and the model file is readable, but loads nothing.
 * Returns 0, or HAPI_EINVAL / -errno with a one-line message in err.
 * Free with hapi_fs_options_free() either way.
 */
int hapi_fs_options_parse(int argc, char **argv, int helper, hapi_fs_options *o,
                          hapi_error *err);

/* Frees what the options own. Accepts a zeroed struct. */
void hapi_fs_options_free(hapi_fs_options *o);

/*
 * Aborts the FUSE connection of the dead mount of ours at o->mountpoint
 * (o->dead_mount): readers still waiting on it end with ECONNABORTED. Logs
 * what it cannot do (it needs root).
 */
void hapi_fs_abort_dead_mount(const hapi_fs_options *o);

/*
 * Detaches the top mount at o->mountpoint, the dead mount of ours
 * (o->dead_mount), and says so on stderr and in the log. Returns 0 or -errno.
 */
int hapi_fs_detach_dead_mount(const hapi_fs_options *o);

/* Parses "123", "64K", "1.5G", "2GiB", "512MB" (powers of 1024) into bytes. Returns 0 or HAPI_EINVAL. */
int hapi_fs_parse_size(const char *text, uint64_t *out);

/* Parses "1ms", "500us", "0.002s", "1" (a bare number is ms) into seconds. Returns 0 or HAPI_EINVAL. */
int hapi_fs_parse_time(const char *text, double *seconds);

/* Prints the usage text. */
void hapi_fs_usage(const char *prog);

#endif
