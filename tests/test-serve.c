/* test-serve.c — the daemon's layers below fs.c without a mount: source, views, serve, background, over a real tiny model. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <turbojpeg.h>
#include <unistd.h>

#include "background.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "pack.h"
#include "serve.h"
#include "source.h"
#include "view.h"

#define PYTHON "/usr/bin/python3"
#define IMAGES 6 /* a/x0.jpg .. a/x5.jpg */

static char tmpdir[] = "/tmp/hapi-test-serve-XXXXXX";
static char model_path[512], src_path[512], cache_path[512];

/* The layers, as hapi_fs_init() stacks them (no tune, no ctl, no FUSE). */
static hapi_source *source;
static hapi_extractor *ex;
static hapi_cache *cache;
static hapi_error_ring *errors;
static hapi_views *views;
static hapi_serve *serve;

static int run(char *const argv[])
{
    pid_t pid = fork();
    if (pid == 0) {
        execv(argv[0], argv);
        _exit(127);
    }
    int status;
    return waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) ? -1 : WEXITSTATUS(status);
}

/* Writes a JPEG of w x h whose pixels depend on seed to path (relative to the source). */
static void write_jpeg(const char *path, int w, int h, int seed)
{
    tjhandle tj = tjInitCompress();
    unsigned char *px = malloc((size_t)w * h * 3), *jpeg = NULL;
    unsigned long size = 0;
    for (int p = 0; p < w * h * 3; p++)
        px[p] = (unsigned char)((p * (seed + 3) + (p / (w * 3)) * 7) & 0xff);
    if (tjCompress2(tj, px, w, 0, h, TJPF_RGB, &jpeg, &size, TJSAMP_420, 90, 0) != 0)
        abort();
    char full[PATH_MAX], tmp[PATH_MAX + 8];
    snprintf(full, sizeof(full), "%s/%s", src_path, path);
    snprintf(tmp, sizeof(tmp), "%s.tmp", full);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(jpeg, 1, size, f) != size || fclose(f) != 0 || rename(tmp, full) != 0)
        abort(); /* rename: a new inode, a new identity */
    tjFree(jpeg);
    free(px);
    tjDestroy(tj);
}

/* The features of path computed directly by the extractor at split (the reference). */
static void *reference(const char *path, int split, size_t *bytes)
{
    void *data = NULL;
    size_t size = 0;
    hapi_error err = { 0 };
    ck_assert_msg(hapi_source_load(source, path, &data, &size, NULL, &err) == 0, "%s", err.message);
    hapi_extractor *e = NULL;
    char word[16];
    snprintf(word, sizeof(word), "%d", split);
    hapi_extractor_config cfg = { .model_path = model_path, .split = word, .threads = 2 };
    ck_assert_msg(hapi_extractor_open(&cfg, &e, &err) == 0, "%s", err.message);
    hapi_decoder *dec = NULL;
    ck_assert_int_eq(hapi_decoder_new(&dec), 0);
    *bytes = hapi_extractor_sample_bytes(e);
    void *out = malloc(*bytes);
    ck_assert_msg(hapi_extractor_compute(e, dec, data, size, out, &err) == 0, "%s", err.message);
    hapi_decoder_free(dec);
    hapi_extractor_close(e);
    free(data);
    return out;
}

/* A view of split made current; returns it with a reference of the caller's own. */
static hapi_view *make_current(int split)
{
    hapi_view *v = NULL;
    hapi_error err = { 0 };
    ck_assert_msg(hapi_serve_view_new(serve, split, 4, 0, &v, &err) == 0, "%s", err.message);
    hapi_view_ref(v);
    hapi_view_put(hapi_views_swap(views, v));
    return v;
}

/* The whole .feat of path at v, read in one call. */
static char *read_feat(hapi_view *v, const char *path, ssize_t *n)
{
    hapi_source_id id;
    ck_assert_int_eq(hapi_source_identity(source, path, &id), 0);
    char *buf = malloc(v->feat_size + 100);
    *n = hapi_serve_read(serve, v, path, &id, buf, v->feat_size + 100, 0);
    return buf;
}

/* ------------------------------------------------------------------ tests */

START_TEST(miss_then_hit)
{
    hapi_view *v = make_current(hapi_extractor_split(ex));
    hapi_serve_stats before, after;
    hapi_serve_stats_get(serve, &before);
    ssize_t n;
    char *first = read_feat(v, "a/x0.jpg", &n);
    ck_assert_int_eq(n, (ssize_t)v->feat_size);
    hapi_serve_stats_get(serve, &after);
    ck_assert_int_eq(after.misses - before.misses, 1);
    ck_assert_int_eq(after.computed - before.computed, 1);

    /* The header is numpy's; the data is what the model computes from the image. */
    char header[HAPI_NPY_HEADER_MAX];
    int hlen = hapi_npy_header(header, hapi_extractor_dtype(ex), v->output.shape, v->output.ndim);
    ck_assert_int_eq(hlen, (int)v->npy_header_len);
    ck_assert_mem_eq(first, header, (size_t)hlen);
    size_t bytes;
    void *ref = reference("a/x0.jpg", v->split, &bytes);
    ck_assert_uint_eq(bytes, v->sample_bytes);
    ck_assert_mem_eq(first + hlen, ref, bytes);

    /* Again: a hit with the same bytes, nothing computed. */
    char *second = read_feat(v, "a/x0.jpg", &n);
    ck_assert_int_eq(n, (ssize_t)v->feat_size);
    ck_assert_mem_eq(second, first, v->feat_size);
    hapi_serve_stats_get(serve, &before);
    ck_assert_int_eq(before.hits - after.hits, 1);
    ck_assert_int_eq(before.computed, after.computed);

    /* Slices: inside the header, across it, past the end. */
    hapi_source_id id;
    hapi_source_identity(source, "a/x0.jpg", &id);
    char part[64];
    ck_assert_int_eq(hapi_serve_read(serve, v, "a/x0.jpg", &id, part, 10, 3), 10);
    ck_assert_mem_eq(part, first + 3, 10);
    ck_assert_int_eq(hapi_serve_read(serve, v, "a/x0.jpg", &id, part, 64, hlen - 32), 64);
    ck_assert_mem_eq(part, first + hlen - 32, 64);
    ck_assert_int_eq(hapi_serve_read(serve, v, "a/x0.jpg", &id, part, 64, (off_t)v->feat_size - 5),
                     5);
    ck_assert_mem_eq(part, first + v->feat_size - 5, 5);
    ck_assert_int_eq(hapi_serve_read(serve, v, "a/x0.jpg", &id, part, 64, (off_t)v->feat_size), 0);

    /* Background work finds it cached. */
    ck_assert_int_eq(hapi_serve_queue(serve, v, "a/x0.jpg", HAPI_PRIORITY_WARM, NULL),
                     HAPI_QUEUE_CACHED);
    free(ref);
    free(first);
    free(second);
    hapi_view_put(v);
}
END_TEST

START_TEST(stale_entry_is_recomputed)
{
    hapi_view *v = make_current(hapi_extractor_split(ex));
    ssize_t n;
    free(read_feat(v, "a/x1.jpg", &n)); /* cached under the old identity */
    ck_assert_int_eq(n, (ssize_t)v->feat_size);
    write_jpeg("a/x1.jpg", 90, 77, 41); /* the source changes */
    hapi_serve_stats before, after;
    hapi_serve_stats_get(serve, &before);
    char *got = read_feat(v, "a/x1.jpg", &n);
    hapi_serve_stats_get(serve, &after);
    ck_assert_int_eq(n, (ssize_t)v->feat_size);
    ck_assert_int_eq(after.stale - before.stale, 1);
    ck_assert_int_eq(after.computed - before.computed, 1);
    size_t bytes;
    void *ref = reference("a/x1.jpg", v->split, &bytes);
    ck_assert_mem_eq(got + v->npy_header_len, ref, bytes);
    free(ref);
    free(got);
    hapi_view_put(v);
}
END_TEST

START_TEST(deleted_source)
{
    hapi_view *v = make_current(hapi_extractor_split(ex));
    ssize_t n;
    free(read_feat(v, "a/x2.jpg", &n));
    hapi_source_id id;
    ck_assert_int_eq(hapi_source_identity(source, "a/x2.jpg", &id), 0);
    char full[PATH_MAX];
    snprintf(full, sizeof(full), "%s/a/x2.jpg", src_path);
    ck_assert_int_eq(unlink(full), 0);

    /* Found deleted: its features go. */
    hapi_serve_stats before, after;
    hapi_serve_stats_get(serve, &before);
    hapi_serve_collect(serve, "a/x2.jpg");
    hapi_serve_stats_get(serve, &after);
    ck_assert_int_eq(after.collected - before.collected, 1);
    hapi_cache_value val;
    ck_assert_int_eq(hapi_cache_get(cache, &v->ns, "a/x2.jpg", &id, &val), 0);
    ck_assert_int_eq(hapi_source_identity(source, "a/x2.jpg", &id), -ENOENT);

    /* A reader that opened it before gets the loader's error, recorded once. */
    char buf[64];
    ck_assert_int_eq(hapi_serve_read(serve, v, "a/x2.jpg", &id, buf, sizeof(buf), 0), -ENOENT);
    hapi_serve_stats_get(serve, &before);
    ck_assert_int_eq(before.errors - after.errors, 1);
    char *json = hapi_error_ring_json(errors, NULL, NULL);
    ck_assert_ptr_nonnull(strstr(json, "a/x2.jpg"));
    free(json);
    ck_assert_int_eq(hapi_serve_queue(serve, v, "a/x2.jpg", HAPI_PRIORITY_WARM, NULL),
                     HAPI_QUEUE_SKIPPED);
    write_jpeg("a/x2.jpg", 84, 70, 2); /* back for the other tests */
    hapi_view_put(v);
}
END_TEST

START_TEST(split_change_keeps_the_old_view_whole)
{
    int split = hapi_extractor_split(ex);
    ck_assert_int_gt(split, 2);
    hapi_view *old = make_current(split);
    ssize_t n;
    hapi_source_id id;
    ck_assert_int_eq(hapi_source_identity(source, "a/x3.jpg", &id), 0);

    /* A reader opened the file at the old split; the split changes under it. */
    hapi_view *nv = make_current(split - 2);
    hapi_view *cur = hapi_views_peek(views);
    ck_assert_ptr_eq(cur, nv);
    hapi_view_put(cur);
    ck_assert_int_ne(memcmp(&old->ns, &nv->ns, sizeof(old->ns)), 0);
    ck_assert_uint_ne(old->feat_size, nv->feat_size);

    char *buf = malloc(old->feat_size);
    n = hapi_serve_read(serve, old, "a/x3.jpg", &id, buf, old->feat_size, 0);
    ck_assert_int_eq(n, (ssize_t)old->feat_size);
    ck_assert_mem_eq(buf, old->npy_header, old->npy_header_len);
    size_t bytes;
    void *ref = reference("a/x3.jpg", split, &bytes);
    ck_assert_mem_eq(buf + old->npy_header_len, ref, bytes);
    free(ref);
    free(buf);

    /* The new view computes the new shape, into its own namespace. */
    char *got = read_feat(nv, "a/x3.jpg", &n);
    ck_assert_int_eq(n, (ssize_t)nv->feat_size);
    ref = reference("a/x3.jpg", split - 2, &bytes);
    ck_assert_uint_eq(bytes, nv->sample_bytes);
    ck_assert_mem_eq(got + nv->npy_header_len, ref, bytes);
    free(ref);
    free(got);
    hapi_view_put(old); /* its batcher stops and goes with this last reference */
    hapi_view_put(nv);
}
END_TEST

START_TEST(undecodable_image_fails_alone)
{
    hapi_view *v = make_current(hapi_extractor_split(ex));
    char full[PATH_MAX];
    snprintf(full, sizeof(full), "%s/a/bad.jpg", src_path);
    FILE *f = fopen(full, "wb");
    fputs("\xff\xd8 not a jpeg", f);
    fclose(f);
    ssize_t n;
    free(read_feat(v, "a/bad.jpg", &n));
    ck_assert_int_lt(n, 0);
    ck_assert_int_lt(n, HAPI_ERRNO_BASE + 1); /* a hapifs code: EIO at the FUSE boundary */
    free(read_feat(v, "a/x4.jpg", &n));        /* the others are served */
    ck_assert_int_eq(n, (ssize_t)v->feat_size);
    unlink(full);
    hapi_view_put(v);
}
END_TEST

START_TEST(pack_rows_are_the_feats)
{
    hapi_view *v = make_current(hapi_extractor_split(ex));
    hapi_packs *packs = NULL;
    ck_assert_int_eq(hapi_packs_new(source, views, serve, &packs), 0);
    char full[PATH_MAX];
    snprintf(full, sizeof(full), "%s/a/bad.jpg", src_path); /* sorts first: row 0 */
    FILE *f = fopen(full, "wb");
    fputs("\xff\xd8 not a jpeg", f);
    fclose(f);

    hapi_pack_info info;
    ck_assert_int_eq(hapi_pack_info_get(packs, "a", &info), 0);
    ck_assert_uint_eq(info.count, IMAGES + 1);
    hapi_pack *k = NULL;
    ck_assert_int_eq(hapi_pack_open(packs, "a", NULL, &k), 0);
    uint64_t size = hapi_pack_size(k);
    ck_assert_uint_eq(size, info.size);
    /* Read in odd slices, as a reader across a network might: rows straddle reads. */
    char *pack = malloc(size + 1000);
    uint64_t got = 0;
    for (;;) {
        ssize_t n = hapi_pack_read(k, pack + got, 777, (off_t)got);
        ck_assert_int_ge(n, 0);
        if (n == 0)
            break;
        got += (uint64_t)n;
    }
    ck_assert_uint_eq(got, size);
    size_t hdr = (size_t)(size - info.count * v->sample_bytes);
    ck_assert_mem_eq(pack, "\x93NUMPY", 6);
    ck_assert_ptr_nonnull(memmem(pack, hdr, "'shape': (7, ", 12));
    /* Row 0 is NaN, rows 1.. are the .feat files of x0.. in order. */
    if (v->dtype == HAPI_DTYPE_FP16) {
        for (size_t b = 0; b < v->sample_bytes; b += 2) /* 0x7e00, little-endian */
            ck_assert(pack[hdr + b] == 0 && (unsigned char)pack[hdr + b + 1] == 0x7e);
    } else {
        for (size_t b = 0; b < v->sample_bytes; b += 4) {
            float x;
            memcpy(&x, pack + hdr + b, 4);
            ck_assert(x != x);
        }
    }
    for (int i = 0; i < IMAGES; i++) {
        char path[32];
        snprintf(path, sizeof(path), "a/x%d.jpg", i);
        ssize_t n;
        char *feat = read_feat(v, path, &n);
        ck_assert_int_eq(n, (ssize_t)v->feat_size);
        ck_assert_mem_eq(pack + hdr + (size_t)(i + 1) * v->sample_bytes, feat + v->npy_header_len,
                         v->sample_bytes);
        free(feat);
    }
    char *index = NULL;
    size_t len = 0;
    ck_assert_int_eq(hapi_pack_index(packs, "a", &index, &len), 0);
    ck_assert_uint_le(len, info.index_bound);
    ck_assert_ptr_nonnull(strstr(index, "\"name\":\"bad.jpg\""));
    ck_assert_ptr_nonnull(strstr(index, "\"status\":\"failed\""));
    ck_assert_ptr_nonnull(strstr(index, v->ns_hex));
    free(index);
    hapi_pack_close(k);

    /* No images directly in the root; a symlink out of the source is not followed. */
    ck_assert_int_eq(hapi_pack_info_get(packs, "", &info), -ENOENT);
    ck_assert_int_lt(hapi_pack_open(packs, "b/out", NULL, &k), 0);
    ck_assert_int_eq(hapi_pack_info_get(packs, "notes.txt", &info), -ENOTDIR);
    hapi_pack_stats ps;
    hapi_pack_stats_get(packs, &ps);
    ck_assert_uint_ge(ps.rows_failed, 1); /* per read that covered the row */
    ck_assert_uint_ge(ps.rows, IMAGES + 1);

    unlink(full);
    free(pack);
    hapi_packs_free(packs);
    hapi_view_put(v);
}
END_TEST

static int count_images(const hapi_source_entry *e, void *arg)
{
    (void)e;
    (*(int *)arg)++;
    return 0;
}

START_TEST(walker_sees_what_the_mount_shows)
{
    int images = 0;
    ck_assert_int_eq(hapi_source_walk(source, "", HAPI_WALK_RECURSE, NULL, count_images, &images),
                     0);
    ck_assert_int_eq(images, IMAGES + 1); /* a/ and b/ */
    int all = 0;
    ck_assert_int_eq(hapi_source_walk(source, "", HAPI_WALK_STAT | HAPI_WALK_ALL, NULL,
                                      count_images, &all), 0);
    ck_assert_int_eq(all, 3); /* a/, b/ and notes.txt; the FIFO is not shown */
    images = 0;
    ck_assert_int_eq(hapi_source_walk(source, "a/x0.jpg", 0, NULL, count_images, &images), 0);
    ck_assert_int_eq(images, 0);
    /* Paths never leave the root. */
    struct stat st;
    ck_assert_int_eq(hapi_source_stat(source, "../", &st), -ENOENT);
    ck_assert_int_eq(hapi_source_stat(source, "b/out", &st), -ENOENT); /* a symlink to / */
}
END_TEST

/*
 * A pack's row read in two parts (the kernel splits reads at pages, inside
 * rows) is of one version of its image, though the image changes and its
 * features leave the cache between the two reads.
 */
START_TEST(a_row_read_in_parts_is_of_one_version)
{
    hapi_view *v = make_current(hapi_extractor_split(ex));
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s/d", src_path);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    write_jpeg("d/w.jpg", 72, 60, 5);
    size_t bytes;
    void *v1 = reference("d/w.jpg", v->split, &bytes);
    hapi_packs *packs = NULL;
    ck_assert_int_eq(hapi_packs_new(source, views, serve, &packs), 0);
    hapi_pack *k = NULL;
    ck_assert_int_eq(hapi_pack_open(packs, "d", NULL, &k), 0);
    uint64_t size = hapi_pack_size(k), hdr = size - v->sample_bytes;
    char *pack = malloc(size);
    uint64_t half = hdr + v->sample_bytes / 2 + 3;
    ck_assert_int_eq(hapi_pack_read(k, pack, half, 0), (ssize_t)half);
    write_jpeg("d/w.jpg", 72, 60, 6); /* another version, and its old features go */
    hapi_error err = { 0 };
    ck_assert_int_ge(hapi_cache_evict_path(cache, &v->ns, "d/w.jpg", &err), 0);
    ck_assert_int_eq(hapi_pack_read(k, pack + half, size - half, (off_t)half),
                     (ssize_t)(size - half));
    ck_assert_mem_eq(pack + hdr, v1, bytes);
    hapi_pack_close(k);
    hapi_packs_free(packs);
    free(pack);
    free(v1);
    snprintf(dir, sizeof(dir), "%s/d/w.jpg", src_path);
    unlink(dir);
    snprintf(dir, sizeof(dir), "%s/d", src_path);
    rmdir(dir);
    hapi_view_put(v);
}
END_TEST

/*
 * A read opened at one identity never gets the features of an older one: a
 * request it joins may have read the image before it changed (here: loaded,
 * then held for a batch that does not fill); that result is not the read's,
 * and the read asks again.
 */
START_TEST(a_read_never_gets_an_older_version)
{
    char dir[PATH_MAX], path[32];
    snprintf(dir, sizeof(dir), "%s/c", src_path);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    write_jpeg("c/z.jpg", 64, 64, 1);
    for (int i = 0; i < 6; i++) { /* large: each takes a while to decode */
        snprintf(path, sizeof(path), "c/big%d.jpg", i);
        write_jpeg(path, 1600, 1600, 10 + i);
    }
    /* a serve whose batches of 8 wait 1 s for company, with one decode thread */
    hapi_serve_config scfg = { .source = source, .ex = ex, .cache = cache, .views = views,
                               .errors = errors, .decode_threads = 1,
                               .batch_wait_us = 1000 * 1000, .mem_budget = 1 << 30 };
    hapi_serve *slow = NULL;
    hapi_view *v = NULL;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_serve_new(&scfg, &slow, &err), 0);
    ck_assert_msg(hapi_serve_view_new(slow, hapi_extractor_split(ex), 8, 0, &v, &err) == 0, "%s",
                  err.message);
    /* z first, then the large ones: z is read, then waits while they decode */
    ck_assert_int_eq(hapi_batcher_submit(v->batcher, "c/z.jpg", HAPI_PRIORITY_DEMAND, NULL), 0);
    for (int i = 0; i < 6; i++) {
        snprintf(path, sizeof(path), "c/big%d.jpg", i);
        ck_assert_int_eq(hapi_batcher_submit(v->batcher, path, HAPI_PRIORITY_DEMAND, NULL), 0);
    }
    hapi_batcher_stats bs;
    do { /* z is read and decoded once the decode thread took the next one */
        usleep(1000);
        hapi_batcher_stats_get(v->batcher, &bs);
    } while (bs.queued[HAPI_PRIORITY_DEMAND] > 5);
    write_jpeg("c/z.jpg", 64, 64, 2); /* then the image changes, and a reader opens it */
    hapi_serve_stats before, after;
    hapi_serve_stats_get(slow, &before);
    uint64_t joined = bs.joined;
    hapi_source_id id;
    ck_assert_int_eq(hapi_source_identity(source, "c/z.jpg", &id), 0);
    char *buf = malloc(v->feat_size);
    ssize_t n = hapi_serve_read(slow, v, "c/z.jpg", &id, buf, v->feat_size, 0);
    hapi_serve_stats_get(slow, &after);
    hapi_batcher_stats_get(v->batcher, &bs);
    ck_assert_int_eq(n, (ssize_t)v->feat_size);
    size_t bytes;
    void *ref = reference("c/z.jpg", v->split, &bytes);
    ck_assert_mem_eq(buf + v->npy_header_len, ref, bytes);
    if (bs.joined > joined) /* it joined the old request (unless that was done: a slow machine) */
        ck_assert_int_eq(after.stale - before.stale, 1);
    free(ref);
    free(buf);
    hapi_view_put(v);
    hapi_serve_free(slow);
    const char *made[] = { "z", "big0", "big1", "big2", "big3", "big4", "big5" };
    for (size_t i = 0; i < sizeof(made) / sizeof(*made); i++) {
        snprintf(dir, sizeof(dir), "%s/c/%s.jpg", src_path, made[i]);
        unlink(dir);
    }
    snprintf(dir, sizeof(dir), "%s/c", src_path);
    rmdir(dir);
}
END_TEST

/* Waits until the warm-up is done (or 60 s); returns its last status (path freed). */
static hapi_warm_status wait_warm(hapi_background *bg)
{
    hapi_warm_status ws;
    for (int i = 0; i < 6000; i++) {
        ck_assert_int_eq(hapi_warm_status_get(bg, &ws), 0);
        free(ws.path);
        if (ws.state == HAPI_WARM_DONE)
            break;
        usleep(10000);
    }
    return ws;
}

struct race {
    hapi_background *bg;
    atomic_int stop;
    int reads;
};

static void *read_status(void *arg)
{
    struct race *r = arg;
    while (!atomic_load(&r->stop)) {
        hapi_warm_status ws;
        if (hapi_warm_status_get(r->bg, &ws) == 0 && ws.path) {
            r->reads += (int)strlen(ws.path) >= 0; /* reads the path: freed memory under ASan */
            free(ws.path);
        }
        /* a pause, or on a loaded machine the warm-up starves behind this loop (seen under
           ASan with 2 busy cores: the 200 starts took over 10 minutes) */
        usleep(20);
    }
    return NULL;
}

START_TEST(warm_up_and_its_status)
{
    hapi_view *v = make_current(hapi_extractor_split(ex));
    hapi_background_config cfg = {
        .source = source, .cache = cache, .views = views, .serve = serve,
        .prefetch = HAPI_PREFETCH_OFF, .cache_size = 0, .warm = 0,
    };
    hapi_background *bg = NULL;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_background_start(&cfg, &bg, &err), 0);
    hapi_warm_status ws;
    ck_assert_int_eq(hapi_warm_status_get(bg, &ws), 0);
    ck_assert_int_eq(ws.state, HAPI_WARM_IDLE);
    ck_assert_ptr_null(ws.path);

    ck_assert_int_eq(hapi_warm_start(bg, "a"), 0);
    ws = wait_warm(bg);
    ck_assert_int_eq(ws.state, HAPI_WARM_DONE);
    ck_assert_int_eq(ws.total, IMAGES);
    ck_assert_int_eq(ws.cached + ws.completed + ws.skipped, IMAGES);
    for (int i = 0; i < IMAGES; i++) { /* every image is a hit now */
        char path[32];
        snprintf(path, sizeof(path), "a/x%d.jpg", i);
        ck_assert_int_eq(hapi_serve_queue(serve, v, path, HAPI_PRIORITY_WARM, NULL),
                         HAPI_QUEUE_CACHED);
    }

    /* Starting warm-ups while the status is read: the path read is never one being freed. */
    struct race r = { bg, 0, 0 };
    pthread_t reader;
    pthread_create(&reader, NULL, read_status, &r);
    /* Every start must happen (a busy one is retried), or the reader races with nothing:
       without the status lock, AddressSanitizer reports a read of a freed root here. */
    for (int i = 0; i < 200; i++) {
        int rc;
        while ((rc = hapi_warm_start(bg, i % 2 ? "a" : "b")) == -EBUSY)
            usleep(100);
        ck_assert_int_eq(rc, 0);
    }
    atomic_store(&r.stop, 1);
    pthread_join(reader, NULL);
    ws = wait_warm(bg);
    ck_assert_int_eq(ws.state, HAPI_WARM_DONE);
    hapi_views_stop(views);
    hapi_background_stop(bg);
    hapi_view_put(v);
}
END_TEST

/* ------------------------------------------------------------------ setup */

int main(void)
{
    const char *root = getenv("HAPI_SOURCE_ROOT");
    char exporter[PATH_MAX];
    snprintf(exporter, sizeof(exporter), "%s/tools/hapifs-export-model", root ? root : ".");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(model_path, sizeof(model_path), "%s/r18.pt", tmpdir);
    snprintf(src_path, sizeof(src_path), "%s/src", tmpdir);
    snprintf(cache_path, sizeof(cache_path), "%s/cache", tmpdir);
    char *export[] = { PYTHON, exporter, "resnet18", "-o", model_path, "--input-size", "64", "-q",
                       NULL };
    char *rm[] = { "/bin/rm", "-rf", tmpdir, NULL };
    char dir[PATH_MAX];
    mkdir(src_path, 0755);
    mkdir(cache_path, 0755);
    snprintf(dir, sizeof(dir), "%s/a", src_path);
    mkdir(dir, 0755);
    snprintf(dir, sizeof(dir), "%s/b", src_path);
    mkdir(dir, 0755);
    snprintf(dir, sizeof(dir), "%s/b/out", src_path);
    if (symlink("/", dir) < 0 || run(export) != 0) {
        fprintf(stderr, "test-serve: cannot export a model with %s\n", exporter);
        run(rm);
        return 1;
    }
    snprintf(dir, sizeof(dir), "%s/b/pipe.jpg", src_path);
    mkfifo(dir, 0644);
    snprintf(dir, sizeof(dir), "%s/notes.txt", src_path);
    FILE *f = fopen(dir, "w");
    fputs("not an image\n", f);
    fclose(f);
    for (int i = 0; i < IMAGES; i++) {
        char path[32];
        snprintf(path, sizeof(path), "a/x%d.jpg", i);
        write_jpeg(path, 80 + 2 * i, 70 + i, i);
    }
    write_jpeg("b/y.jpg", 72, 72, 9);

    hapi_error err = { 0 };
    hapi_extractor_config cfg = { .model_path = model_path, .split = "auto", .threads = 2 };
    hapi_cache_options copt = { .max_bytes = 64 << 20 };
    hapi_serve_config scfg = { .decode_threads = 1, .batch_wait_us = 1000, .mem_budget = 1 << 30 };
    if (hapi_source_open(src_path, &source, &err) < 0 ||
        hapi_extractor_open(&cfg, &ex, &err) < 0 ||
        hapi_cache_open(cache_path, &copt, &cache, &err) < 0 ||
        !(errors = hapi_error_ring_new()) ||
        hapi_views_new(ex, hapi_extractor_dtype(ex), HAPI_PRECISION_FP32, &views, &err) < 0) {
        fprintf(stderr, "test-serve: %s\n", err.message);
        run(rm);
        return 1;
    }
    scfg.source = source, scfg.ex = ex, scfg.cache = cache, scfg.views = views;
    scfg.errors = errors;
    if (hapi_serve_new(&scfg, &serve, &err) < 0) {
        fprintf(stderr, "test-serve: %s\n", err.message);
        run(rm);
        return 1;
    }

    Suite *s = suite_create("serve");
    struct {
        const char *name;
        const TTest *test;
    } cases[] = {
        { "miss_then_hit", miss_then_hit },
        { "stale_entry_is_recomputed", stale_entry_is_recomputed },
        { "deleted_source", deleted_source },
        { "split_change_keeps_the_old_view_whole", split_change_keeps_the_old_view_whole },
        { "undecodable_image_fails_alone", undecodable_image_fails_alone },
        { "walker_sees_what_the_mount_shows", walker_sees_what_the_mount_shows },
        { "pack_rows_are_the_feats", pack_rows_are_the_feats },
        { "a_read_never_gets_an_older_version", a_read_never_gets_an_older_version },
        { "a_row_read_in_parts_is_of_one_version", a_row_read_in_parts_is_of_one_version },
        { "warm_up_and_its_status", warm_up_and_its_status }, /* last: it stops the views */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, cases[i].test);
        suite_add_tcase(s, tc);
    }
    SRunner *sr = srunner_create(s);
    /* libtorch has run in this process: a forked child would inherit a dead thread pool */
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    hapi_views_free(views);
    hapi_serve_free(serve);
    hapi_error_ring_free(errors);
    hapi_cache_close(cache);
    hapi_extractor_close(ex);
    hapi_source_close(source);
    run(rm);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
