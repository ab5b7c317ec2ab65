/* ctl.h — the .hapifs/ control files and the table of commands. */
#ifndef HAPI_FUSEFS_CTL_H
#define HAPI_FUSEFS_CTL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "background.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "options.h"
#include "pack.h"
#include "remote.h"
#include "serve.h"
#include "shared.h"
#include "source.h"
#include "tune.h"
#include "uring.h"
#include "view.h"
#include "watch.h"

/* Names of the control files, NULL-terminated. */
extern const char *const hapi_ctl_files[];
#define HAPI_CTL_WRITABLE "ctl"  /* the one that takes commands */
#define HAPI_CTL_MODEL "model"   /* the model archive, read through */
#define HAPI_CTL_LINE_MAX 4096

/* The FUSE requests a mount has answered, by type (stats: requests). */
enum hapi_fs_request {
    HAPI_REQ_LOOKUP, HAPI_REQ_FORGET, HAPI_REQ_GETATTR, HAPI_REQ_OPENDIR, HAPI_REQ_READDIR,
    HAPI_REQ_RELEASEDIR, HAPI_REQ_OPEN, HAPI_REQ_READ, HAPI_REQ_RELEASE, HAPI_REQ_STATFS,
    HAPI_REQ_OTHER, HAPI_REQ_COUNT
};
extern const char *const hapi_fs_request_names[HAPI_REQ_COUNT];
typedef struct hapi_fs_requests {
    atomic_uint_fast64_t n[HAPI_REQ_COUNT];
} hapi_fs_requests;

typedef struct hapi_ctl_config {
    const hapi_fs_options *opt;
    const hapi_fs_requests *requests;
    hapi_source *source;
    hapi_extractor *ex;
    hapi_cache *cache;
    hapi_views *views;
    hapi_serve *serve;
    hapi_packs *packs;
    hapi_background *background;
    hapi_tune *tune;
    hapi_remote *remote;       /* a compute-side mount: the layers above remote are NULL */
    hapi_error_ring *errors;
    hapi_node *node;             /* the node's shared budget and cores; NULL: none */
    hapi_watch *watch;           /* the source's watch; NULL: none (watch=0, remote) */
    int no_open;                 /* the kernel opens files without asking (in effect) */
    hapi_uring *const *uring;    /* the session's io_uring workers (*uring NULL: none) */
    const int *epochs;           /* the kernel forgets every name at one notice (hapi_fs.epochs) */
    const atomic_uint_fast64_t *epoch_notices; /* and how many it was sent */
    uint64_t started_ns;
    const hapi_precision_choice *precision_auto; /* precision=auto's measures; NULL: none */
} hapi_ctl_config;

typedef struct hapi_ctl hapi_ctl;
/* Makes the control layer over borrowed layers. Returns 0 or -ENOMEM. */
int hapi_ctl_new(const hapi_ctl_config *cfg, hapi_ctl **out);
void hapi_ctl_free(hapi_ctl *c);

/*
 * A control file's content, shared by reference: a reply may be written from
 * it while the handle that holds it is released.
 */
typedef struct hapi_ctl_text {
    atomic_int refs;
    size_t len;
    char data[];
} hapi_ctl_text;
/* Adds a reference; returns t. */
hapi_ctl_text *hapi_ctl_text_ref(hapi_ctl_text *t);
/* Drops one; the last frees. Accepts NULL. */
void hapi_ctl_text_put(hapi_ctl_text *t);
/* A text holding a copy of data. NULL on out-of-memory. */
hapi_ctl_text *hapi_ctl_text_new(const char *data, size_t len);

/*
 * The content of control file name ("config", "stats", ...) now (one
 * reference), or NULL, as who may see it: NULL is the mount's owner or root,
 * who see everything. Others see in errors only the errors of paths whose
 * names they could list in the source tree ("hidden" counts the rest; on a
 * remote mount, none), and in stats "(hidden)" for such a warm-up path and
 * for a remote source's last error.
 */
hapi_ctl_text *hapi_ctl_render(hapi_ctl *c, const char *name, const hapi_cred *who);

/*
 * Carries out the commands in text (one per line: "warm [PATH]", ...), once
 * every line has passed hapi_ctl_check(). Returns 0, or -EINVAL / -EBUSY /
 * -EAGAIN / -ENOENT / -EIO with a message in err; nothing is changed by the
 * command that fails (earlier lines stand: a path that does not exist or a
 * split the model does not have is found only when its line runs).
 */
int hapi_ctl_command(hapi_ctl *c, const char *text, size_t len, hapi_error *err);

/*
 * Checks text as commands of a mount (remote or not) without any layer: the
 * command names, their words, the values (sizes, rates, times, numbers) and
 * that paths stay beneath the mount. Returns 0 or -EINVAL with err. Pure.
 */
int hapi_ctl_check(const char *text, size_t len, int remote, hapi_error *err);

#endif
