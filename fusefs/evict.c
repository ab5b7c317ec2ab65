/* evict.c — the step of an evict walk: remove one path's cached features and count them. */
#include "evict.h"

int hapi_evict_walk_path(hapi_evict_walk *w, const char *path)
{
    int rc = hapi_cache_evict_path(w->cache, w->ns, path, w->err);
    if (rc < 0)
        return rc;
    w->count += rc;
    return 0;
}

int hapi_evict_walk_entry(const hapi_source_entry *e, void *arg)
{
    return hapi_evict_walk_path(arg, e->path);
}
