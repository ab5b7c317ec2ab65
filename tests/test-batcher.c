/* test-batcher.c — the batcher over a real tiny model: single flight, priorities, failures alone, budget, shutdown. */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <turbojpeg.h>
#include <unistd.h>

#include "extractor.h"

#define PYTHON "/usr/bin/python3"
#define NKEYS 24

static char tmpdir[] = "/tmp/hapi-test-batcher-XXXXXX";
static char model_path[PATH_MAX];
static hapi_extractor *ex;

/* The "source files": JPEGs made in memory, one per key "k<N>"; "bad<N>" are corrupt. */
static unsigned char *jpeg[NKEYS];
static unsigned long jpeg_size[NKEYS];

/* What the loader and the sink saw. Guarded by rec_lock. */
static pthread_mutex_t rec_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cond = PTHREAD_COND_INITIALIZER;
static int gate_closed;          /* the loader blocks while set */
static int loads[NKEYS + 8];     /* per key index */
static char order[256][16];      /* keys in the order the sink got them */
static int norder;
static int sink_batches;
static uint64_t sink_ok, sink_failed;
static int tag_mismatches;       /* asserted in the main thread: check cannot fail in others */
static unsigned requests[NKEYS + 8][HAPI_PRIORITY_COUNT]; /* answered, per key, by priority */
static hapi_batcher *resubmit_in_sink; /* if set, the sink asks for each key again */
static int resubmit_rc[NKEYS + 8];   /* ... and what that returned */

static int key_index(const char *key)
{
    return atoi(key + (key[0] == 'k' ? 1 : 3)) + (key[0] == 'k' ? 0 : NKEYS);
}

static int load(void *ctx, const char *key, void **data, size_t *size, void *tag, hapi_error *err)
{
    (void)ctx;
    int i = key_index(key);
    memcpy(tag, &i, sizeof(i));
    if (i < 0 || i >= NKEYS + 8)
        return hapi_error_set(err, -ENOENT, "no such key");
    pthread_mutex_lock(&rec_lock);
    while (gate_closed)
        pthread_cond_wait(&gate_cond, &rec_lock);
    loads[i]++;
    pthread_mutex_unlock(&rec_lock);
    if (key[0] == 'b') {
        /* a JPEG cut in the middle */
        *size = jpeg_size[0] / 2;
        *data = malloc(*size);
        memcpy(*data, jpeg[0], *size);
        return 0;
    }
    if (i >= NKEYS)
        return hapi_error_set(err, -ENOENT, "no such key");
    *size = jpeg_size[i];
    *data = malloc(*size);
    memcpy(*data, jpeg[i], *size);
    return 0;
}

static void sink(void *ctx, const hapi_batch_result *r, size_t n)
{
    (void)ctx;
    pthread_mutex_lock(&rec_lock);
    sink_batches++;
    for (size_t i = 0; i < n; i++) {
        if (norder < 256)
            snprintf(order[norder++], sizeof(order[0]), "%s", r[i].key);
        if (r[i].code == 0)
            sink_ok++;
        else
            sink_failed++;
        int tag;
        memcpy(&tag, r[i].tag, sizeof(tag));
        if (tag != key_index(r[i].key)) /* the tag comes back with its key */
            tag_mismatches++;
        for (int p = 0; p < HAPI_PRIORITY_COUNT; p++)
            requests[key_index(r[i].key)][p] += r[i].requests[p];
    }
    hapi_batcher *again = resubmit_in_sink;
    pthread_mutex_unlock(&rec_lock);
    for (size_t i = 0; again && i < n; i++) {
        int rc = hapi_batcher_submit(again, r[i].key, HAPI_PRIORITY_WARM, NULL);
        pthread_mutex_lock(&rec_lock);
        resubmit_rc[key_index(r[i].key)] = rc;
        pthread_mutex_unlock(&rec_lock);
    }
}

static void reset_records(void)
{
    pthread_mutex_lock(&rec_lock);
    memset(loads, 0, sizeof(loads));
    norder = 0;
    sink_batches = 0;
    sink_ok = sink_failed = 0;
    tag_mismatches = 0;
    gate_closed = 0;
    memset(requests, 0, sizeof(requests));
    resubmit_in_sink = NULL;
    memset(resubmit_rc, 0, sizeof(resubmit_rc));
    pthread_mutex_unlock(&rec_lock);
}

static hapi_batcher *start_workers(int batch, int wait_us, int decoders, uint64_t budget,
                                   int workers)
{
    hapi_batcher_config cfg = {
        .batch = batch, .max_wait_us = wait_us, .decode_threads = decoders,
        .mem_budget = budget, .tag_size = sizeof(int), .load = load, .sink = sink,
        .workers = workers,
    };
    hapi_batcher *b = NULL;
    hapi_error err = { 0 };
    reset_records();
    ck_assert_msg(hapi_batcher_new(ex, &cfg, &b, &err) == 0, "%s", err.message);
    return b;
}

static hapi_batcher *start(int batch, int wait_us, int decoders, uint64_t budget)
{
    return start_workers(batch, wait_us, decoders, budget, 1);
}

static void finish_batcher(hapi_batcher *b)
{
    hapi_batcher_free(b);
    ck_assert_int_eq(tag_mismatches, 0);
}

static void key_name(char *buf, int i)
{
    snprintf(buf, 16, "k%d", i);
}

/* Waits for key and copies its features into out. */
static int fetch(hapi_batcher *b, const char *key, int priority, void *out)
{
    hapi_ticket *t;
    const void *f;
    hapi_error err = { 0 };
    /* joining a result being delivered is as good (HAPI_BATCHER_DELIVERED) */
    ck_assert_int_ge(hapi_batcher_submit(b, key, priority, &t), 0);
    int rc = hapi_ticket_wait(b, t, &f, NULL, &err);
    if (rc == 0)
        memcpy(out, f, hapi_extractor_sample_bytes(ex));
    hapi_ticket_release(b, t);
    return rc;
}

/* The features of one image computed alone, the reference for everything batched. */
static void reference(int i, void *out)
{
    hapi_decoder *dec;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_decoder_new(&dec), 0);
    ck_assert_int_eq(hapi_extractor_compute(ex, dec, jpeg[i], jpeg_size[i], out, &err), 0);
    hapi_decoder_free(dec);
}

static int close_enough(const float *a, const float *b, size_t n)
{
    float scale = 0;
    for (size_t i = 0; i < n; i++)
        scale = fabsf(b[i]) > scale ? fabsf(b[i]) : scale;
    for (size_t i = 0; i < n; i++)
        if (fabsf(a[i] - b[i]) > 1e-4f * scale + 1e-6f)
            return 0;
    return 1;
}

struct fetcher {
    hapi_batcher *b;
    const char *key;
    float out[512];
    int rc;
};

static void *fetch_thread(void *arg)
{
    struct fetcher *f = arg;
    f->rc = fetch(f->b, f->key, HAPI_PRIORITY_DEMAND, f->out);
    return NULL;
}

static void close_gate(void)
{
    pthread_mutex_lock(&rec_lock);
    gate_closed = 1;
    pthread_mutex_unlock(&rec_lock);
}

static void open_gate(void)
{
    pthread_mutex_lock(&rec_lock);
    gate_closed = 0;
    pthread_cond_broadcast(&gate_cond);
    pthread_mutex_unlock(&rec_lock);
}

#define WAIT_NS 30000000000ull /* deadline of every wait for the batcher's threads */

/*
 * Fills st from b's stats once cond holds. After WAIT_NS it opens the gate
 * (so that nothing stays blocked) and fails with the message.
 */
#define WAIT_STATS(b, st, cond, ...)                      \
    do {                                                  \
        uint64_t deadline_ = hapi_now_ns() + WAIT_NS;     \
        for (;;) {                                        \
            hapi_batcher_stats_get((b), &(st));           \
            if (cond)                                     \
                break;                                    \
            if (hapi_now_ns() >= deadline_) {             \
                open_gate();                              \
                ck_abort_msg(__VA_ARGS__);                \
            }                                             \
            usleep(1000);                                 \
        }                                                 \
    } while (0)

START_TEST(single_flight)
{
    hapi_batcher *b = start(8, 2000, 1, 0);
    struct fetcher f[12];
    pthread_t th[12];
    hapi_batcher_stats st;
    close_gate(); /* the first request's load waits: the 11 others come while it runs */
    for (int i = 0; i < 12; i++) {
        f[i] = (struct fetcher){ .b = b, .key = "k3" };
        pthread_create(&th[i], NULL, fetch_thread, &f[i]);
    }
    WAIT_STATS(b, st, st.joined == 11, "%llu of 11 requests joined the first one's k3",
               (unsigned long long)st.joined);
    open_gate();
    for (int i = 0; i < 12; i++)
        pthread_join(th[i], NULL);
    float ref[512];
    reference(3, ref);
    for (int i = 0; i < 12; i++) {
        ck_assert_int_eq(f[i].rc, 0);
        ck_assert(close_enough(f[i].out, ref, 512));
    }
    hapi_batcher_stats_get(b, &st);
    pthread_mutex_lock(&rec_lock);
    int loads3 = loads[3];
    pthread_mutex_unlock(&rec_lock);
    ck_assert_int_eq(st.samples, 1);
    ck_assert_int_eq(loads3, 1);
    ck_assert_int_eq(st.joined, 11);
    finish_batcher(b);
}
END_TEST

START_TEST(batches_equal_singles)
{
    /*
     * All 16 are asked for before any is loaded (the gate), so a batch runs
     * when 8 are ready or nothing more is coming. The partial-batch wait is
     * long so that a decode thread descheduled on a loaded machine does not
     * cut batches short; a batcher that runs samples one by one still fails.
     */
    hapi_batcher *b = start(8, 10 * 1000 * 1000, 2, 0);
    struct fetcher f[16];
    pthread_t th[16];
    char keys[16][16];
    hapi_batcher_stats st;
    close_gate();
    for (int i = 0; i < 16; i++) {
        key_name(keys[i], i);
        f[i] = (struct fetcher){ .b = b, .key = keys[i] };
        pthread_create(&th[i], NULL, fetch_thread, &f[i]);
    }
    /* nothing passes the gate: each request is queued or with a decode thread */
    WAIT_STATS(b, st, st.queued[HAPI_PRIORITY_DEMAND] + st.in_flight == 16,
               "only %llu of 16 requests queued",
               (unsigned long long)(st.queued[HAPI_PRIORITY_DEMAND] + st.in_flight));
    open_gate();
    for (int i = 0; i < 16; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 16; i++) {
        float ref[512];
        reference(i, ref);
        ck_assert_int_eq(f[i].rc, 0);
        ck_assert_msg(close_enough(f[i].out, ref, 512), "key %d", i);
    }
    hapi_batcher_stats_get(b, &st);
    ck_assert_int_eq(st.samples, 16);
    ck_assert_int_le(st.batches, 8); /* batched, not one by one */
    ck_assert_int_eq(sink_ok, 16);
    finish_batcher(b);
}
END_TEST

/* Two inference workers, each taking its own batches: every sample is right and comes once;
   a batcher of more workers than HAPI_BATCHER_WORKERS_MAX is refused. */
START_TEST(workers_run_batches_side_by_side)
{
    hapi_batcher *b = start_workers(4, 1000, 2, 0, 2);
    struct fetcher f[NKEYS];
    pthread_t th[NKEYS];
    char keys[NKEYS][16];
    for (int i = 0; i < NKEYS; i++) {
        key_name(keys[i], i);
        f[i] = (struct fetcher){ .b = b, .key = keys[i] };
        pthread_create(&th[i], NULL, fetch_thread, &f[i]);
    }
    for (int i = 0; i < NKEYS; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < NKEYS; i++) {
        float ref[512];
        reference(i, ref);
        ck_assert_int_eq(f[i].rc, 0);
        ck_assert_msg(close_enough(f[i].out, ref, 512), "key %d", i);
    }
    hapi_batcher_stats st;
    hapi_batcher_stats_get(b, &st);
    ck_assert_int_eq(st.samples, NKEYS);
    ck_assert_int_eq(sink_ok, NKEYS);
    finish_batcher(b);

    hapi_batcher_config cfg = { .batch = 4, .decode_threads = 1, .tag_size = sizeof(int),
                                .load = load, .sink = sink,
                                .workers = HAPI_BATCHER_WORKERS_MAX + 1 };
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_batcher_new(ex, &cfg, &b, &err), HAPI_EINVAL);
    ck_assert_ptr_null(b);
}
END_TEST

/* A demand read of a queued warm item moves it ahead of the other warm items. */
START_TEST(demand_promotes_warm)
{
    hapi_batcher *b = start(1, 0, 1, 0);
    char key[16];
    hapi_batcher_stats st;
    close_gate(); /* hold the decode thread so everything stays queued */
    for (int i = 0; i < 10; i++) {
        key_name(key, i);
        ck_assert_int_eq(hapi_batcher_submit(b, key, HAPI_PRIORITY_WARM, NULL), 0);
    }
    /* the decode thread has k0 (and waits at the gate); k1..k9 are queued */
    WAIT_STATS(b, st, st.in_flight == 1, "the decode thread never took k0");
    ck_assert_int_eq(st.queued[HAPI_PRIORITY_WARM], 9);
    struct fetcher f = { .b = b, .key = "k9" };
    pthread_t th;
    pthread_create(&th, NULL, fetch_thread, &f);
    WAIT_STATS(b, st, st.joined == 1, "the demand read of k9 never joined the queued one");
    ck_assert_int_eq(st.promoted, 1);
    ck_assert_int_eq(st.queued[HAPI_PRIORITY_DEMAND], 1); /* moved up, not duplicated */
    ck_assert_int_eq(st.queued[HAPI_PRIORITY_DEMAND] + st.queued[HAPI_PRIORITY_WARM], 9);
    open_gate();
    pthread_join(th, NULL);
    ck_assert_int_eq(f.rc, 0);
    /* the rest of the warm-up finishes too */
    WAIT_STATS(b, st, st.samples == 10, "%llu of 10 samples computed",
               (unsigned long long)st.samples);
    /* k0 was already with the decode thread; k9 came before every other warm item */
    char first[16], second[16];
    pthread_mutex_lock(&rec_lock);
    memcpy(first, order[0], sizeof(first));
    memcpy(second, order[1], sizeof(second));
    int loads9 = loads[9];
    pthread_mutex_unlock(&rec_lock);
    ck_assert_msg((strcmp(first, "k0") == 0 && strcmp(second, "k9") == 0) ||
                      (strcmp(first, "k9") == 0 && strcmp(second, "k0") == 0),
                  "order %s %s", first, second);
    ck_assert_int_eq(loads9, 1);
    finish_batcher(b);
}
END_TEST

/*
 * A result counts every request it answers, by priority, whoever asked
 * first: a warm-up that joins a reader's sample (or a reader that joins the
 * warm-up's) sees it answered. A request made once the result is with the
 * sink is told so and counted by no result; else a warm-up waits forever
 * for a completion that was counted before it asked.
 */
START_TEST(requests_are_counted_once)
{
    hapi_batcher *b = start(1, 0, 1, 0);
    pthread_mutex_lock(&rec_lock);
    gate_closed = 1; /* everything stays queued: the requests below join */
    pthread_mutex_unlock(&rec_lock);
    hapi_ticket *t;
    ck_assert_int_eq(hapi_batcher_submit(b, "k1", HAPI_PRIORITY_DEMAND, &t), 0);
    ck_assert_int_eq(hapi_batcher_submit(b, "k1", HAPI_PRIORITY_WARM, NULL), 0);
    ck_assert_int_eq(hapi_batcher_submit(b, "k1", HAPI_PRIORITY_WARM, NULL), 0);
    ck_assert_int_eq(hapi_batcher_submit(b, "k2", HAPI_PRIORITY_WARM, NULL), 0);
    ck_assert_int_eq(hapi_batcher_submit(b, "k2", HAPI_PRIORITY_PREFETCH, NULL), 0);
    ck_assert_int_eq(hapi_batcher_submit(b, "bad1", HAPI_PRIORITY_WARM, NULL), 0);
    ck_assert_int_eq(hapi_batcher_submit(b, "bad1", HAPI_PRIORITY_DEMAND, NULL), 0);
    pthread_mutex_lock(&rec_lock);
    resubmit_in_sink = b;
    pthread_mutex_unlock(&rec_lock);
    open_gate();
    const void *f;
    ck_assert_int_eq(hapi_ticket_wait(b, t, &f, NULL, NULL), 0);
    hapi_ticket_release(b, t);
    hapi_batcher_stats st;
    do {
        usleep(10000);
        hapi_batcher_stats_get(b, &st);
    } while (st.samples + st.failed < 3);
    int k1 = key_index("k1"), k2 = key_index("k2"), bad = key_index("bad1");
    unsigned seen[3][HAPI_PRIORITY_COUNT];
    int again[3];
    pthread_mutex_lock(&rec_lock); /* copied out: a failed check must not leave it locked */
    resubmit_in_sink = NULL;
    memcpy(seen[0], requests[k1], sizeof(seen[0]));
    memcpy(seen[1], requests[k2], sizeof(seen[1]));
    memcpy(seen[2], requests[bad], sizeof(seen[2]));
    again[0] = resubmit_rc[k1], again[1] = resubmit_rc[k2], again[2] = resubmit_rc[bad];
    pthread_mutex_unlock(&rec_lock);
    finish_batcher(b);
    ck_assert_int_eq(seen[0][HAPI_PRIORITY_DEMAND], 1);
    ck_assert_int_eq(seen[0][HAPI_PRIORITY_WARM], 2);
    ck_assert_int_eq(seen[1][HAPI_PRIORITY_WARM], 1);
    ck_assert_int_eq(seen[1][HAPI_PRIORITY_PREFETCH], 1);
    ck_assert_int_eq(seen[2][HAPI_PRIORITY_WARM], 1); /* a failure, on a decode thread */
    ck_assert_int_eq(seen[2][HAPI_PRIORITY_DEMAND], 1);
    /* asked again from the sink, before the samples are done: told, and counted nowhere */
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(again[i], HAPI_BATCHER_DELIVERED);
}
END_TEST

START_TEST(failure_is_alone)
{
    hapi_batcher *b = start(8, 100000, 2, 0);
    struct fetcher f[6];
    pthread_t th[6];
    const char *keys[] = { "k1", "bad1", "k2", "k3", "bad2", "k4" };
    for (int i = 0; i < 6; i++) {
        f[i] = (struct fetcher){ .b = b, .key = keys[i] };
        pthread_create(&th[i], NULL, fetch_thread, &f[i]);
    }
    for (int i = 0; i < 6; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 6; i++)
        ck_assert_int_eq(f[i].rc, keys[i][0] == 'b' ? HAPI_EDECODE : 0);
    ck_assert_int_eq(sink_ok, 4);
    ck_assert_int_eq(sink_failed, 2);
    /* a missing source is its loader's error, passed through */
    float out[512];
    ck_assert_int_eq(fetch(b, "k99", HAPI_PRIORITY_DEMAND, out), -ENOENT);
    finish_batcher(b);
}
END_TEST

START_TEST(throttle_and_stop)
{
    hapi_batcher *b = start(4, 0, 1, 0);
    char key[16];
    pthread_mutex_lock(&rec_lock);
    gate_closed = 1;
    pthread_mutex_unlock(&rec_lock);
    for (int i = 0; i < 6; i++) {
        key_name(key, i);
        ck_assert_int_eq(hapi_batcher_submit(b, key, HAPI_PRIORITY_WARM, NULL), 0);
    }
    /* 5 queued (one is with the blocked decode thread): under 10 returns at once */
    ck_assert_int_eq(hapi_batcher_throttle(b, HAPI_PRIORITY_WARM, 10), 0);
    hapi_batcher_stop(b);
    ck_assert_int_eq(hapi_batcher_throttle(b, HAPI_PRIORITY_WARM, 0), -ECANCELED);
    ck_assert_int_eq(hapi_batcher_submit(b, "k7", HAPI_PRIORITY_DEMAND, NULL), -ECANCELED);
    pthread_mutex_lock(&rec_lock);
    gate_closed = 0;
    pthread_cond_broadcast(&gate_cond);
    pthread_mutex_unlock(&rec_lock);
    finish_batcher(b); /* what was queued fails with -ECANCELED, nothing leaks */
}
END_TEST

START_TEST(budget_bounds_memory)
{
    /* one sample's tensor and image is ~60 KB here; a budget of 100 KB allows one at a time */
    hapi_batcher *b = start(4, 1000, 4, 100 << 10);
    struct fetcher f[NKEYS];
    pthread_t th[NKEYS];
    char keys[NKEYS][16];
    hapi_batcher_stats st;
    close_gate(); /* every request is there before the first load: the decode threads contend */
    for (int i = 0; i < NKEYS; i++) {
        key_name(keys[i], i);
        f[i] = (struct fetcher){ .b = b, .key = keys[i] };
        pthread_create(&th[i], NULL, fetch_thread, &f[i]);
    }
    WAIT_STATS(b, st, st.queued[HAPI_PRIORITY_DEMAND] + st.in_flight == NKEYS,
               "only %llu of %d requests queued",
               (unsigned long long)(st.queued[HAPI_PRIORITY_DEMAND] + st.in_flight), NKEYS);
    open_gate();
    for (int i = 0; i < NKEYS; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(f[i].rc, 0);
    }
    hapi_batcher_stats_get(b, &st);
    ck_assert_int_eq(st.samples, NKEYS);
    ck_assert_int_gt(st.mem_waits, 0);
    ck_assert_int_le(st.mem_peak, (100 << 10) + (100 << 10)); /* one sample over at most */
    ck_assert_int_eq(st.mem_in_use, 0);
    finish_batcher(b);
}
END_TEST

/* A batcher whose decoders cannot start says so at once instead of leaving tickets waiting. */
START_TEST(decoders_must_start)
{
    hapi_batcher_config cfg = {
        .batch = 4, .max_wait_us = 1000, .decode_threads = 2, .tag_size = sizeof(int),
        .load = load, .sink = sink, .fault_decoders_fail = 2,
    };
    hapi_batcher *b = (hapi_batcher *)&cfg; /* must be set to NULL */
    hapi_error err = { 0 };
    reset_records();
    uint64_t t0 = hapi_now_ns();
    ck_assert_int_eq(hapi_batcher_new(ex, &cfg, &b, &err), -ENOMEM);
    ck_assert_ptr_null(b);
    ck_assert_ptr_nonnull(strstr(err.message, "decoder"));
    ck_assert_uint_lt(hapi_now_ns() - t0, 5000000000u);

    /* One of two fails: the other does the work. */
    cfg.fault_decoders_fail = 1;
    ck_assert_msg(hapi_batcher_new(ex, &cfg, &b, &err) == 0, "%s", err.message);
    hapi_batcher_stats st;
    hapi_batcher_stats_get(b, &st);
    ck_assert_uint_eq(st.decoders, 1);
    hapi_ticket *t = NULL;
    const void *features;
    ck_assert_int_eq(hapi_batcher_submit(b, "k3", HAPI_PRIORITY_DEMAND, &t), 0);
    ck_assert_int_eq(hapi_ticket_wait(b, t, &features, NULL, &err), 0);
    ck_assert_ptr_nonnull(features);
    hapi_ticket_release(b, t);
    finish_batcher(b);
    ck_assert_uint_eq(sink_ok, 1);
}
END_TEST

/* ------------------------------------------------------------------ setup */

static void make_images(void)
{
    tjhandle tj = tjInitCompress();
    for (int i = 0; i < NKEYS; i++) {
        int w = 80 + i, h = 70 + 2 * i;
        unsigned char *px = malloc((size_t)w * h * 3);
        for (int p = 0; p < w * h * 3; p++)
            px[p] = (unsigned char)((p * (i + 3) + (p / (w * 3)) * 7) & 0xff);
        jpeg[i] = NULL;
        if (tjCompress2(tj, px, w, 0, h, TJPF_RGB, &jpeg[i], &jpeg_size[i], TJSAMP_420, 90, 0) != 0) {
            fprintf(stderr, "tjCompress2: %s\n", tjGetErrorStr2(tj));
            exit(1);
        }
        free(px);
    }
    tjDestroy(tj);
}

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
    char *export[] = { PYTHON, exporter, "resnet18", "-o", model_path, "--input-size", "64", "-q",
                       NULL };
    char *rm[] = { "/bin/rm", "-rf", tmpdir, NULL };
    if (run(export) != 0) {
        fprintf(stderr, "test-batcher: cannot export a model with %s\n", exporter);
        run(rm);
        return 1;
    }
    hapi_extractor_config cfg = { .model_path = model_path, .split = "auto", .threads = 2 };
    hapi_error err = { 0 };
    if (hapi_extractor_open(&cfg, &ex, &err) < 0) {
        fprintf(stderr, "test-batcher: %s\n", err.message);
        run(rm);
        return 1;
    }
    make_images();

    Suite *s = suite_create("batcher");
    struct {
        const char *name;
        const TTest *test;
    } cases[] = {
        { "single_flight", single_flight },
        { "batches_equal_singles", batches_equal_singles },
        { "workers_run_batches_side_by_side", workers_run_batches_side_by_side },
        { "demand_promotes_warm", demand_promotes_warm },
        { "requests_are_counted_once", requests_are_counted_once },
        { "failure_is_alone", failure_is_alone },
        { "throttle_and_stop", throttle_and_stop },
        { "budget_bounds_memory", budget_bounds_memory },
        { "decoders_must_start", decoders_must_start },
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
    hapi_extractor_close(ex);
    for (int i = 0; i < NKEYS; i++)
        tjFree(jpeg[i]);
    run(rm);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
