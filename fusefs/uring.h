/* uring.h — FUSE over io_uring. */
#ifndef HAPI_FUSEFS_URING_H
#define HAPI_FUSEFS_URING_H

#include <stdint.h>

#include "hapi.h"

/* libfuse's session: uring.c speaks FUSE, its callers need not. */
struct fuse_session;

/*
 * FUSE over io_uring: requests served on the CPU that made them, by worker
 * threads that each hold one ring entry of that CPU's queue (uring.c says why
 * and how). Requests the ring does not carry still come through /dev/fuse.
 */
typedef struct hapi_uring hapi_uring;
typedef struct hapi_uring_stats {
    int queues;        /* one per possible CPU */
    int workers;       /* threads, each with one entry */
    int registered;    /* entries the kernel holds now */
    int active;        /* every worker's entry is registered: the kernel uses the ring */
    uint64_t requests; /* requests served through the ring */
} hapi_uring_stats;
/* 1 if the kernel offers the transport (the fuse module's enable_uring is set). */
int hapi_uring_available(void);
/*
 * Installs the custom io on se (mounted; its /dev/fuse) and starts the
 * workers, threads per queue (at most 256 in all, at least two per queue);
 * they register once
 * hapi_uring_initialized is called. Returns 0 or -errno with err; *out is
 * NULL on failure, and se is then unchanged.
 */
int hapi_uring_start(struct fuse_session *se, int threads, hapi_uring **out, hapi_error *err);
/* Called from the INIT handler: the workers may register. Accepts NULL. */
void hapi_uring_initialized(hapi_uring *u);
/* A copy of the counters; zeros for NULL. */
void hapi_uring_stats_get(const hapi_uring *u, hapi_uring_stats *s);
/*
 * Stops the workers (each finishes the request it serves) and frees u; the
 * kernel's entries are cancelled. Call after unmounting and before the
 * session is destroyed. Accepts NULL.
 */
void hapi_uring_stop(hapi_uring *u);

#endif
