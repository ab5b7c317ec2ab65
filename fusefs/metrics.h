/* metrics.h — .hapifs/metrics: the stats in the Prometheus text format. */
#ifndef HAPI_FUSEFS_METRICS_H
#define HAPI_FUSEFS_METRICS_H

/*
 * .hapifs/metrics: stats (the JSON of .hapifs/stats) in the Prometheus text
 * exposition format, every sample labelled with mountpoint (metrics.c says
 * how names are made). *text is malloc'd, NUL-terminated. Returns 0 or -ENOMEM.
 */
typedef struct json_t json_t; /* jansson's */
int hapi_metrics_render(json_t *stats, const char *mountpoint, char **text);

#endif
