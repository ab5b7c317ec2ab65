/* evict.h — removing the cached features an evict walk finds, counted: the step serve.c's and remote-walk.c's evict walks share. */
#ifndef HAPI_EVICT_H
#define HAPI_EVICT_H

#include "cache.h"
#include "hapi.h"
#include "source.h"

/*
 * One evict walk's state: where it removes from, what it removed so far and
 * where its failure goes. The caller owns it (on its stack, for the walk);
 * cache, ns and err are borrowed for as long. Not shared between threads.
 */
typedef struct hapi_evict_walk {
    hapi_cache *cache;
    const hapi_cache_namespace *ns; /* the namespace of the paths walked (a walk may change it) */
    int count;                      /* features removed so far */
    hapi_error *err;                /* filled by the failure that ends the walk, or NULL */
} hapi_evict_walk;

/* Removes the features of path (relative to the source root) in w->ns and counts them. Returns 0, or < 0 with w->err. */
int hapi_evict_walk_path(hapi_evict_walk *w, const char *path);

/* hapi_evict_walk_path() as hapi_source_walk()'s function (arg: the hapi_evict_walk). */
int hapi_evict_walk_entry(const hapi_source_entry *e, void *arg);

#endif
