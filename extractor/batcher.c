/* batcher.c — storage-side batching: single-flight requests, priority queues, a decode pool pipelined with inference, a memory budget. */
#include "extractor.h"

#include <errno.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

/*
 * A job is one sample on its way: QUEUED (in a priority queue), DECODING (a
 * decode thread has it), READY (a preprocessed tensor waits for a batch),
 * RUNNING (in inference), DONE (features or an error). Jobs are found by key
 * until they are DONE, so a second request for a key joins the first; after
 * that, the sink has stored the result and the caller finds it there.
 *
 * One mutex guards all of it. Work outside the lock: loading, decoding and
 * preprocessing (decode threads), copying tensors into the batch and running
 * the model (the inference threads: cfg.workers, each taking its own batches),
 * and the sink.
 *
 * A job is freed when its last reference goes: the batcher holds one until
 * DONE, each ticket holds one.
 */
enum job_state { JOB_QUEUED, JOB_DECODING, JOB_READY, JOB_RUNNING, JOB_DONE };

struct job {
    char *key;
    int priority;
    int origin;
    int state;
    int refs;
    int code;
    char message[256];
    float *tensor;          /* READY: 3 * crop * crop floats */
    void *features;         /* DONE with code 0 */
    uint64_t mem;           /* bytes accounted to this job now */
    uint64_t ready_ns;
    uint64_t node_mem;       /* bytes drawn from the node budget */
    uint8_t tag[HAPI_BATCHER_TAG_MAX];
    unsigned requests[HAPI_PRIORITY_COUNT]; /* that it answers, by priority */
    int delivered;          /* the sink has (or is getting) its result: requests is final */
    struct job *prev, *next; /* in a queue or a ready list */
    struct job *hash_next;
};

struct list {
    struct job *head, *tail;
    size_t count;
};

struct hapi_batcher {
    hapi_extractor *ex;
    hapi_batcher_config cfg;
    size_t tensor_floats;
    size_t sample_bytes;
    int split, dtype;
    int workers;                  /* inference threads (cfg.workers, at least 1) */

    pthread_mutex_t lock;
    pthread_cond_t work_cond;     /* decode threads: jobs queued or memory freed */
    pthread_cond_t ready_cond;    /* inference thread: tensors ready */
    pthread_cond_t done_cond;     /* ticket holders: jobs done */
    pthread_cond_t throttle_cond; /* throttled submitters: queues shrank, or a wake */
    uint64_t throttle_wakes;      /* hapi_batcher_wake() calls (under lock) */
    int stop;
    hapi_stop_flag node_stop;     /* stop, for the node's waits (read without the lock) */

    struct list queue[HAPI_PRIORITY_COUNT];
    struct list ready[HAPI_PRIORITY_COUNT];
    size_t decoding;
    struct job **table;
    size_t table_size;

    uint64_t mem_estimate;        /* running estimate of a sample's transient bytes */
    uint64_t mem_of_waiters;      /* held by decode threads waiting for the budget */
    int batch;                    /* current batch size; halved on out-of-memory */
    hapi_batcher_stats stats;

    pthread_t *decoders;
    int ndecoders;                /* threads created */
    int decoders_reported;        /* of those, how many said whether their decoder started */
    int decoders_running;         /* ... and how many have one */
    pthread_cond_t start_cond;    /* hapi_batcher_new: a decode thread reported */
    pthread_t *inference;         /* cfg.workers threads */
    int ninference;               /* created */
};

/* ------------------------------------------------------------------ lists */

static void list_push(struct list *l, struct job *j)
{
    j->next = NULL;
    j->prev = l->tail;
    if (l->tail)
        l->tail->next = j;
    else
        l->head = j;
    l->tail = j;
    l->count++;
}

static void list_remove(struct list *l, struct job *j)
{
    if (j->prev)
        j->prev->next = j->next;
    else
        l->head = j->next;
    if (j->next)
        j->next->prev = j->prev;
    else
        l->tail = j->prev;
    j->prev = j->next = NULL;
    l->count--;
}

static struct job *list_pop(struct list *l)
{
    struct job *j = l->head;
    if (j)
        list_remove(l, j);
    return j;
}

/* ------------------------------------------------------------------ table */

static size_t slot_of(const hapi_batcher *b, const char *key)
{
    return (size_t)(XXH3_64bits(key, strlen(key)) & (b->table_size - 1));
}

static struct job *table_find(hapi_batcher *b, const char *key)
{
    for (struct job *j = b->table[slot_of(b, key)]; j; j = j->hash_next)
        if (strcmp(j->key, key) == 0)
            return j;
    return NULL;
}

static void table_remove(hapi_batcher *b, struct job *j)
{
    struct job **link = &b->table[slot_of(b, j->key)];
    while (*link && *link != j)
        link = &(*link)->hash_next;
    if (*link)
        *link = j->hash_next;
    j->hash_next = NULL;
}

static void job_unref(struct job *j)
{
    if (--j->refs > 0)
        return;
    free(j->key);
    free(j->tensor);
    free(j->features);
    free(j);
}

/* ----------------------------------------------------------------- memory */

static void mem_add(hapi_batcher *b, struct job *j, int64_t delta)
{
    j->mem = (uint64_t)((int64_t)j->mem + delta);
    b->stats.mem_in_use = (uint64_t)((int64_t)b->stats.mem_in_use + delta);
    if (b->stats.mem_in_use > b->stats.mem_peak)
        b->stats.mem_peak = b->stats.mem_in_use;
    if (delta < 0)
        pthread_cond_broadcast(&b->work_cond);
}

/*
 * Whether a decode thread may start one more sample. Something must always
 * be allowed to run, or a budget smaller than one sample would deadlock.
 */
static int mem_allows(const hapi_batcher *b)
{
    if (!b->cfg.mem_budget || b->stats.mem_in_use == 0)
        return 1;
    return b->stats.mem_in_use + b->mem_estimate <= b->cfg.mem_budget;
}

/* Gives back bytes of what j drew from the node budget. */
static void node_give(hapi_batcher *b, struct job *j, uint64_t bytes)
{
    if (bytes > j->node_mem)
        bytes = j->node_mem;
    j->node_mem -= bytes;
    hapi_node_mem_give(b->cfg.node, bytes);
}

/* ------------------------------------------------------------------- jobs */

static void finish(hapi_batcher *b, struct job *j, int code, const char *message)
{
    j->state = JOB_DONE;
    j->code = code;
    if (code < 0) {
        snprintf(j->message, sizeof(j->message), "%s", message ? message : hapi_strerror(code));
        b->stats.failed++;
    } else {
        b->stats.samples++;
    }
    mem_add(b, j, -(int64_t)j->mem);
    node_give(b, j, j->node_mem);
    table_remove(b, j);
    pthread_cond_broadcast(&b->done_cond);
    job_unref(j);
}

static size_t queued_total(const hapi_batcher *b)
{
    size_t n = 0;
    for (int p = 0; p < HAPI_PRIORITY_COUNT; p++)
        n += b->queue[p].count;
    return n;
}

static size_t ready_total(const hapi_batcher *b)
{
    size_t n = 0;
    for (int p = 0; p < HAPI_PRIORITY_COUNT; p++)
        n += b->ready[p].count;
    return n;
}

/*
 * Marks jobs delivered and gives their results the requests they answer,
 * before the sink has them: a request that comes after this joins a result
 * already delivered (hapi_batcher_submit says so), so every request is
 * counted by exactly one result.
 */
static void deliver(hapi_batcher *b, struct job **jobs, hapi_batch_result *results, size_t n)
{
    pthread_mutex_lock(&b->lock);
    for (size_t i = 0; i < n; i++) {
        jobs[i]->delivered = 1;
        memcpy(results[i].requests, jobs[i]->requests, sizeof(results[i].requests));
    }
    pthread_mutex_unlock(&b->lock);
}

/* ------------------------------------------------------- decode threads */

/* Loads, decodes and preprocesses one job outside the lock. */
static int prepare(hapi_batcher *b, hapi_decoder *dec, struct job *j, hapi_error *err)
{
    const hapi_preprocess *pp = hapi_extractor_preprocess(b->ex);
    void *data = NULL;
    size_t size = 0;
    hapi_image img = { 0 };
    int64_t transient = 0;
    uint64_t tensor_bytes = b->tensor_floats * sizeof(float);
    int rc = b->cfg.load(b->cfg.ctx, j->key, &data, &size, j->tag, err);
    if (rc < 0)
        return rc;
    j->tensor = malloc(b->tensor_floats * sizeof(float));
    if (!j->tensor) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory for an input tensor");
        goto out;
    }
    /*
     * Admission at dequeue was on an estimate. Now that the header tells the
     * real size, wait for room in the budget before allocating the image —
     * but only while someone who is not waiting holds memory, who will free
     * it. Otherwise (only waiters hold any) this sample goes over alone; two
     * threads waiting on each other's reservations would wait forever.
     */
    int w = 0, h = 0;
    if (hapi_image_size(data, size, &w, &h) == 0)
        transient = (int64_t)size + (int64_t)w * h * 4; /* CMYK decodes to 4 bytes a pixel */
    else
        transient = (int64_t)size;
    pthread_mutex_lock(&b->lock);
    while (b->cfg.mem_budget && !b->stop &&
           b->stats.mem_in_use + (uint64_t)transient > b->cfg.mem_budget &&
           b->stats.mem_in_use > b->mem_of_waiters + j->mem) {
        b->stats.mem_waits++;
        b->mem_of_waiters += j->mem;
        pthread_cond_wait(&b->work_cond, &b->lock);
        b->mem_of_waiters -= j->mem;
    }
    mem_add(b, j, transient);
    /* what a sample really costs in flight, for the next admission decisions */
    b->mem_estimate = (b->mem_estimate * 7 + (uint64_t)transient +
                       b->tensor_floats * sizeof(float)) / 8;
    pthread_mutex_unlock(&b->lock);
    /* the node's budget, which the other mounts draw from too: the image and the tensor */
    if (hapi_node_mem_take(b->cfg.node, (uint64_t)transient + tensor_bytes, &b->node_stop) < 0) {
        rc = hapi_error_set(err, -ECANCELED, "shutting down");
        goto out;
    }
    j->node_mem = (uint64_t)transient + tensor_bytes;
    rc = hapi_image_decode(dec, data, size, pp->max_pixels,
                           pp->mode == HAPI_PREPROCESS_FAST ? pp->resize : 0, &img, err);
    if (rc < 0)
        goto out;
    rc = hapi_image_preprocess(&img, pp, j->tensor, err);
out:
    hapi_image_release(&img);
    free(data);
    if (transient) {
        pthread_mutex_lock(&b->lock);
        mem_add(b, j, -transient);
        pthread_mutex_unlock(&b->lock);
    }
    if (j->node_mem > tensor_bytes)
        node_give(b, j, j->node_mem - tensor_bytes); /* the tensor's part goes with it */
    return rc;
}

static void *decode_main(void *arg)
{
    hapi_batcher *b = arg;
    pthread_setname_np(pthread_self(), "hapifs-decode");
    hapi_decoder *dec = NULL;
    int ok = hapi_decoder_new(&dec) == 0;

    /* hapi_batcher_new waits for every thread's word: with no decoder at all, it fails. */
    pthread_mutex_lock(&b->lock);
    if (ok && b->decoders_reported < b->cfg.fault_decoders_fail) {
        hapi_decoder_free(dec); /* testing: this one "fails" */
        dec = NULL;
        ok = 0;
    }
    b->decoders_reported++;
    b->decoders_running += ok;
    pthread_cond_broadcast(&b->start_cond);
    if (!ok) {
        pthread_mutex_unlock(&b->lock);
        return NULL; /* the other threads carry on */
    }
    for (;;) {
        struct job *j = NULL;
        if (b->stop)
            break;
        if (mem_allows(b)) {
            for (int p = 0; p < HAPI_PRIORITY_COUNT && !j; p++)
                j = list_pop(&b->queue[p]);
        } else if (queued_total(b)) {
            b->stats.mem_waits++;
        }
        if (!j) {
            pthread_cond_wait(&b->work_cond, &b->lock);
            continue;
        }
        pthread_cond_broadcast(&b->throttle_cond);
        j->state = JOB_DECODING;
        b->decoding++;
        mem_add(b, j, (int64_t)(b->tensor_floats * sizeof(float)));
        pthread_mutex_unlock(&b->lock);

        hapi_error err = { 0 };
        uint64_t t0 = hapi_now_ns();
        int rc = prepare(b, dec, j, &err);
        uint64_t t1 = hapi_now_ns();

        if (rc < 0) {
            /* A sample that cannot be read fails alone, before it meets a batch. */
            hapi_batch_result r = { j->key, j->tag, NULL, rc, err.message, j->priority,
                                    j->origin, { 0 } };
            deliver(b, &j, &r, 1);
            b->cfg.sink(b->cfg.ctx, &r, 1);
        }
        pthread_mutex_lock(&b->lock);
        b->decoding--;
        b->stats.decode_ns += t1 - t0;
        if (rc < 0) {
            free(j->tensor);
            j->tensor = NULL;
            finish(b, j, rc, err.message);
        } else {
            j->state = JOB_READY;
            j->ready_ns = t1;
            list_push(&b->ready[j->priority], j);
        }
        pthread_cond_signal(&b->ready_cond);
    }
    pthread_mutex_unlock(&b->lock);
    hapi_decoder_free(dec);
    return NULL;
}

/* -------------------------------------------------------- inference thread */

/* Runs n prepared samples; on out-of-memory halves the batch and retries the same samples. */
static int run_batch(hapi_batcher *b, float *input, int n, void *output, hapi_error *err)
{
    size_t in_stride = b->tensor_floats;
    size_t out_size = (size_t)n * b->sample_bytes;
    int rc;
    if (b->cfg.fault_oom_above > 0 && n > b->cfg.fault_oom_above)
        rc = hapi_error_set(err, HAPI_EOOM, "out of memory (injected above %d samples)",
                            b->cfg.fault_oom_above);
    else
        rc = hapi_model_run(hapi_extractor_model(b->ex), b->split, input, n, b->dtype, output,
                            out_size, err);
    if (rc != HAPI_EOOM || n == 1)
        return rc;
    int half = n / 2;
    pthread_mutex_lock(&b->lock);
    b->stats.oom_splits++;
    if (b->batch > half)
        b->batch = half > 0 ? half : 1; /* and the next batches stay smaller */
    pthread_mutex_unlock(&b->lock);
    rc = run_batch(b, input, half, output, err);
    if (rc == 0)
        rc = run_batch(b, input + (size_t)half * in_stride, n - half,
                       (char *)output + (size_t)half * b->sample_bytes, err);
    return rc;
}

/*
 * The inference thread's buffers for `cap` samples: the batch's jobs and results, its input
 * tensors and its output features. batch_buffers_init() allocates them. Without the jobs'
 * or the results' array cap is 0 and no sample is taken until batch_buffers_grow() gets
 * them; without the input or the output every batch fails with -ENOMEM (batch_compute).
 * The thread owns them and frees them with batch_buffers_free().
 */
struct batch_buffers {
    int cap;
    struct job **jobs;
    hapi_batch_result *results;
    float *input;
    char *output;
};

static void batch_buffers_init(const hapi_batcher *b, struct batch_buffers *bb)
{
    bb->cap = b->cfg.batch;
    bb->jobs = calloc((size_t)bb->cap, sizeof(*bb->jobs));
    bb->results = calloc((size_t)bb->cap, sizeof(*bb->results));
    bb->input = malloc((size_t)bb->cap * b->tensor_floats * sizeof(float));
    bb->output = malloc((size_t)bb->cap * b->sample_bytes);
    if (!bb->jobs || !bb->results)
        bb->cap = 0; /* nothing can be taken until they exist (batch_buffers_grow) */
}

static void batch_buffers_free(struct batch_buffers *bb)
{
    free(bb->jobs);
    free(bb->results);
    free(bb->input);
    free(bb->output);
}

/* hapi_batcher_set_batch() raised the batch: grow the buffers first. What cannot grow keeps its
   size, and cap with it. */
static void batch_buffers_grow(const hapi_batcher *b, struct batch_buffers *bb)
{
    struct job **nj = realloc(bb->jobs, (size_t)b->batch * sizeof(*bb->jobs));
    bb->jobs = nj ? nj : bb->jobs;
    hapi_batch_result *nr = realloc(bb->results, (size_t)b->batch * sizeof(*bb->results));
    bb->results = nr ? nr : bb->results;
    float *ni = realloc(bb->input, (size_t)b->batch * b->tensor_floats * sizeof(float));
    bb->input = ni ? ni : bb->input;
    char *no = realloc(bb->output, (size_t)b->batch * b->sample_bytes);
    bb->output = no ? no : bb->output;
    if (nj && nr && ni && no)
        bb->cap = b->batch;
}

/*
 * Run when the batch is full, when nothing more is coming (no sample
 * queued or decoding), or when the oldest ready sample has waited
 * max_wait: a lone reader is not held back for company that never comes.
 * Under the lock, with nready samples ready (at least one): returns 0 when the batch should run
 * now, or waits for more (at most until that deadline) and returns 1.
 */
static int batch_wait_for_more(hapi_batcher *b, size_t nready)
{
    int full = nready >= (size_t)b->batch;
    int nothing_coming = queued_total(b) == 0 && b->decoding == 0;
    if (full || nothing_coming)
        return 0;
    uint64_t oldest = UINT64_MAX;
    for (int p = 0; p < HAPI_PRIORITY_COUNT; p++)
        if (b->ready[p].head && b->ready[p].head->ready_ns < oldest)
            oldest = b->ready[p].head->ready_ns;
    uint64_t deadline = oldest + (uint64_t)b->cfg.max_wait_us * 1000;
    uint64_t now = hapi_now_ns();
    if (now >= deadline)
        return 0;
    struct timespec ts;
    hapi_deadline_after_ns(&ts, deadline - now);
    pthread_cond_timedwait(&b->ready_cond, &b->lock, &ts);
    return 1;
}

/* Under the lock: moves up to a batch of ready jobs into bb->jobs, highest priority first, and
   marks them RUNNING. Returns how many. */
static int batch_take(hapi_batcher *b, struct batch_buffers *bb)
{
    int n = 0;
    int take = b->batch < bb->cap ? b->batch : bb->cap;
    for (int p = 0; p < HAPI_PRIORITY_COUNT && n < take; p++) {
        struct job *j;
        while (n < take && (j = list_pop(&b->ready[p])) != NULL) {
            j->state = JOB_RUNNING;
            bb->jobs[n++] = j;
        }
    }
    return n;
}

/* Copies the n jobs' tensors into the batch's input and frees them, giving back their memory. */
static void batch_gather(hapi_batcher *b, struct batch_buffers *bb, int n)
{
    struct job **jobs = bb->jobs;
    for (int i = 0; i < n; i++) {
        memcpy(bb->input + (size_t)i * b->tensor_floats, jobs[i]->tensor,
               b->tensor_floats * sizeof(float));
        free(jobs[i]->tensor);
        jobs[i]->tensor = NULL;
    }
    pthread_mutex_lock(&b->lock);
    for (int i = 0; i < n; i++)
        mem_add(b, jobs[i], -(int64_t)(b->tensor_floats * sizeof(float)));
    pthread_mutex_unlock(&b->lock);
    for (int i = 0; i < n; i++)
        node_give(b, jobs[i], jobs[i]->node_mem);
}

/*
 * Outside the lock: runs the n taken jobs through the model into bb->output. *threads_now is
 * the thread's torch threads, 0 until the node has set them; *t0 is when the run began.
 * Returns 0, -ENOMEM (a buffer is missing), -ECANCELED (stopping) or the model's code.
 */
static int batch_compute(hapi_batcher *b, struct batch_buffers *bb, int n, int *threads_now,
                         uint64_t *t0, hapi_error *err)
{
    /* the jobs and results exist: batch_take() took n of them */
    int rc = !bb->input || !bb->output ? hapi_error_set(err, -ENOMEM, "out of memory for a batch")
                                       : 0;
    *t0 = hapi_now_ns();
    if (rc < 0)
        return rc;
    batch_gather(b, bb, n);
    /* the node's cores, divided among the mounts busy computing, and this mount's share among
       its workers */
    int want = hapi_batcher_worker_threads(b->cfg.node_cores, b->workers);
    int tokens = hapi_node_cores_take(b->cfg.node, want, 0, &b->node_stop);
    int threads = tokens > 0 ? tokens : b->workers > 1 && !b->cfg.node ? want : 0;
    if (threads > 0 && threads != *threads_now) {
        hapi_model_set_threads(threads); /* as many threads as cores granted */
        *threads_now = threads;
    }
    *t0 = hapi_now_ns();
    rc = tokens < 0 ? hapi_error_set(err, -ECANCELED, "shutting down")
                    : run_batch(b, bb->input, n, bb->output, err);
    hapi_node_cores_give(b->cfg.node, tokens);
    return rc;
}

/* Each job's result of a batch that returned rc: its own copy of its features, or the error.
   The features belong to the job (freed with it). */
static void batch_fill_results(hapi_batcher *b, struct batch_buffers *bb, int n, int rc,
                               const hapi_error *err)
{
    for (int i = 0; i < n; i++) {
        struct job *j = bb->jobs[i];
        int code = rc;
        if (code == 0) {
            j->features = malloc(b->sample_bytes);
            if (j->features)
                memcpy(j->features, bb->output + (size_t)i * b->sample_bytes, b->sample_bytes);
            else
                code = -ENOMEM;
        }
        bb->results[i] = (hapi_batch_result){ j->key, j->tag, j->features, code,
                                              code < 0 ? (rc < 0 ? err->message : "out of memory")
                                                       : NULL,
                                              j->priority, j->origin, { 0 } };
    }
}

static void *inference_main(void *arg)
{
    hapi_batcher *b = arg;
    pthread_setname_np(pthread_self(), "hapifs-infer");
    struct batch_buffers bb;
    batch_buffers_init(b, &bb);
    int threads_now = 0; /* this thread's inference threads, once the node has set them */

    pthread_mutex_lock(&b->lock);
    while (!b->stop) {
        size_t nready = ready_total(b);
        if (nready == 0) {
            pthread_cond_wait(&b->ready_cond, &b->lock);
            continue;
        }
        if (batch_wait_for_more(b, nready))
            continue;
        if (b->batch > bb.cap)
            batch_buffers_grow(b, &bb);
        int n = batch_take(b, &bb);
        pthread_mutex_unlock(&b->lock);
        if (n == 0) {
            /* no memory for a batch's arrays: the samples wait, none is lost; try again soon */
            nanosleep(&(struct timespec){ .tv_nsec = 10 * 1000 * 1000 }, NULL);
            pthread_mutex_lock(&b->lock);
            continue;
        }

        hapi_error err = { 0 };
        uint64_t t0;
        int rc = batch_compute(b, &bb, n, &threads_now, &t0, &err);
        uint64_t t1 = hapi_now_ns();
        batch_fill_results(b, &bb, n, rc, &err);
        deliver(b, bb.jobs, bb.results, (size_t)n);
        b->cfg.sink(b->cfg.ctx, bb.results, (size_t)n);

        pthread_mutex_lock(&b->lock);
        b->stats.batches++;
        b->stats.inference_ns += t1 - t0;
        for (int i = 0; i < n; i++)
            finish(b, bb.jobs[i], bb.results[i].code, bb.results[i].message);
    }
    pthread_mutex_unlock(&b->lock);
    batch_buffers_free(&bb);
    return NULL;
}

/* ------------------------------------------------------------------ API */

int hapi_batcher_worker_threads(int threads, int workers)
{
    int n = threads / (workers > 0 ? workers : 1);
    return n > 0 ? n : 1;
}

/* Starts n threads running fn(b) into t, counting those started in *started (what
   hapi_batcher_free() joins). 0 or -errno, with err saying which threads. */
static int start_threads(hapi_batcher *b, pthread_t *t, int n, int *started,
                         void *(*fn)(void *), const char *what, hapi_error *err)
{
    for (int i = 0; i < n; i++) {
        int rc = pthread_create(&t[i], NULL, fn, b);
        if (rc != 0)
            return hapi_error_set(err, -rc, "cannot start %s threads: %s", what,
                                  hapi_strerror(-rc));
        (*started)++;
    }
    return 0;
}

int hapi_batcher_new(hapi_extractor *ex, const hapi_batcher_config *cfg, hapi_batcher **out,
                     hapi_error *err)
{
    hapi_batcher *b;
    int rc;

    *out = NULL;
    if (!ex || !cfg || cfg->batch < 1 || cfg->batch > HAPI_BATCH_MAX || cfg->decode_threads < 1 ||
        cfg->decode_threads > 256 || cfg->workers < 0 || cfg->workers > HAPI_BATCHER_WORKERS_MAX ||
        cfg->max_wait_us < 0 || cfg->tag_size > HAPI_BATCHER_TAG_MAX ||
        !cfg->load || !cfg->sink || cfg->split < 0 ||
        cfg->split > hapi_model_num_stages(hapi_extractor_model(ex)))
        return hapi_error_set(err, HAPI_EINVAL, "bad batcher configuration");
    b = calloc(1, sizeof(*b));
    if (!b)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    b->ex = ex;
    b->cfg = *cfg;
    b->workers = cfg->workers > 0 ? cfg->workers : 1;
    b->batch = cfg->batch;
    b->split = cfg->split > 0 ? cfg->split : hapi_extractor_split(ex);
    b->dtype = hapi_extractor_dtype(ex);
    b->sample_bytes = hapi_extractor_split_bytes(ex, b->split);
    size_t crop = (size_t)hapi_extractor_preprocess(ex)->crop;
    b->tensor_floats = 3 * crop * crop;
    b->mem_estimate = b->tensor_floats * sizeof(float) * 2;
    b->table_size = 4096;
    b->table = calloc(b->table_size, sizeof(*b->table));
    b->decoders = calloc((size_t)cfg->decode_threads, sizeof(*b->decoders));
    b->inference = calloc((size_t)b->workers, sizeof(*b->inference));
    if (!b->table || !b->decoders || !b->inference) {
        free(b->table);
        free(b->decoders);
        free(b->inference);
        free(b);
        return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    pthread_mutex_init(&b->lock, NULL);
    hapi_cond_init_monotonic(&b->ready_cond);
    pthread_cond_init(&b->work_cond, NULL);
    pthread_cond_init(&b->done_cond, NULL);
    pthread_cond_init(&b->throttle_cond, NULL);
    pthread_cond_init(&b->start_cond, NULL);

    if ((rc = start_threads(b, b->inference, b->workers, &b->ninference, inference_main,
                            "inference", err)) < 0 ||
        (rc = start_threads(b, b->decoders, cfg->decode_threads, &b->ndecoders, decode_main,
                            "decode", err)) < 0) {
        hapi_batcher_free(b);
        return rc;
    }
    pthread_mutex_lock(&b->lock);
    while (b->decoders_reported < b->ndecoders)
        pthread_cond_wait(&b->start_cond, &b->lock);
    int running = b->decoders_running;
    pthread_mutex_unlock(&b->lock);
    if (running == 0) {
        hapi_error_set(err, -ENOMEM, "no decode thread could create its decoder (%d tried)",
                       b->ndecoders);
        hapi_batcher_free(b);
        return -ENOMEM;
    }
    *out = b;
    return 0;
}

void hapi_batcher_stop(hapi_batcher *b)
{
    pthread_mutex_lock(&b->lock);
    b->stop = 1;
    atomic_store(&b->node_stop, 1);
    pthread_cond_broadcast(&b->work_cond);
    pthread_cond_broadcast(&b->ready_cond);
    pthread_cond_broadcast(&b->throttle_cond);
    pthread_mutex_unlock(&b->lock);
}

void hapi_batcher_free(hapi_batcher *b)
{
    if (!b)
        return;
    hapi_batcher_stop(b);
    for (int i = 0; i < b->ndecoders; i++)
        pthread_join(b->decoders[i], NULL);
    for (int i = 0; i < b->ninference; i++)
        pthread_join(b->inference[i], NULL);
    /* Whatever did not finish fails; no ticket may outlive the batcher. */
    pthread_mutex_lock(&b->lock);
    for (int p = 0; p < HAPI_PRIORITY_COUNT; p++) {
        struct job *j;
        while ((j = list_pop(&b->queue[p])) != NULL)
            finish(b, j, -ECANCELED, "shutting down");
        while ((j = list_pop(&b->ready[p])) != NULL)
            finish(b, j, -ECANCELED, "shutting down");
    }
    pthread_mutex_unlock(&b->lock);
    pthread_mutex_destroy(&b->lock);
    pthread_cond_destroy(&b->work_cond);
    pthread_cond_destroy(&b->ready_cond);
    pthread_cond_destroy(&b->done_cond);
    pthread_cond_destroy(&b->throttle_cond);
    pthread_cond_destroy(&b->start_cond);
    free(b->table);
    free(b->decoders);
    free(b->inference);
    free(b);
}

int hapi_batcher_submit(hapi_batcher *b, const char *key, int priority, hapi_ticket **ticket)
{
    if (ticket)
        *ticket = NULL;
    if (priority < 0 || priority >= HAPI_PRIORITY_COUNT)
        return HAPI_EINVAL;
    pthread_mutex_lock(&b->lock);
    if (b->stop) {
        pthread_mutex_unlock(&b->lock);
        return -ECANCELED;
    }
    struct job *j = table_find(b, key);
    int rc = 0;
    if (j) {
        b->stats.joined++;
        if (j->delivered)
            rc = HAPI_BATCHER_DELIVERED; /* between the sink and done: the result is there */
        else
            j->requests[priority]++;
        if (priority < j->priority) {
            /* A reader now waits for a queued warm-up item: move it up, don't duplicate it. */
            b->stats.promoted++;
            if (j->state == JOB_QUEUED) {
                list_remove(&b->queue[j->priority], j);
                list_push(&b->queue[priority], j);
                pthread_cond_broadcast(&b->throttle_cond);
            } else if (j->state == JOB_READY) {
                list_remove(&b->ready[j->priority], j);
                list_push(&b->ready[priority], j);
            }
            j->priority = priority;
        }
    } else {
        j = calloc(1, sizeof(*j));
        char *k = strdup(key);
        if (!j || !k) {
            free(j);
            free(k);
            pthread_mutex_unlock(&b->lock);
            return -ENOMEM;
        }
        j->key = k;
        j->priority = priority;
        j->origin = priority;
        j->requests[priority] = 1;
        j->state = JOB_QUEUED;
        j->refs = 1;
        size_t s = slot_of(b, key);
        j->hash_next = b->table[s];
        b->table[s] = j;
        list_push(&b->queue[priority], j);
        pthread_cond_signal(&b->work_cond);
    }
    if (ticket) {
        j->refs++;
        *ticket = (hapi_ticket *)j;
    }
    pthread_mutex_unlock(&b->lock);
    return rc;
}

int hapi_ticket_wait(hapi_batcher *b, hapi_ticket *t, const void **features, const void **tag,
                     hapi_error *err)
{
    struct job *j = (struct job *)t;
    pthread_mutex_lock(&b->lock);
    while (j->state != JOB_DONE)
        pthread_cond_wait(&b->done_cond, &b->lock);
    pthread_mutex_unlock(&b->lock);
    /* A DONE job never changes again, and the ticket keeps it alive. */
    *features = j->features;
    if (tag)
        *tag = j->tag;
    if (j->code < 0)
        return hapi_error_set(err, j->code, "%s", j->message);
    return 0;
}

void hapi_ticket_release(hapi_batcher *b, hapi_ticket *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&b->lock);
    job_unref((struct job *)t);
    pthread_mutex_unlock(&b->lock);
}

int hapi_batcher_throttle(hapi_batcher *b, int priority, size_t limit)
{
    int rc = 0;
    pthread_mutex_lock(&b->lock);
    uint64_t wakes = b->throttle_wakes;
    while (!b->stop && b->queue[priority].count > limit && b->throttle_wakes == wakes)
        pthread_cond_wait(&b->throttle_cond, &b->lock);
    if (b->stop)
        rc = -ECANCELED;
    else if (b->throttle_wakes != wakes)
        rc = -EINTR;
    pthread_mutex_unlock(&b->lock);
    return rc;
}

void hapi_batcher_wake(hapi_batcher *b)
{
    pthread_mutex_lock(&b->lock);
    b->throttle_wakes++;
    pthread_cond_broadcast(&b->throttle_cond);
    pthread_mutex_unlock(&b->lock);
}

int hapi_batcher_set_batch(hapi_batcher *b, int batch)
{
    if (batch < 1 || batch > HAPI_BATCH_MAX)
        return HAPI_EINVAL;
    pthread_mutex_lock(&b->lock);
    b->batch = batch;
    pthread_cond_signal(&b->ready_cond);
    pthread_mutex_unlock(&b->lock);
    return 0;
}

void hapi_batcher_stats_get(hapi_batcher *b, hapi_batcher_stats *st)
{
    pthread_mutex_lock(&b->lock);
    *st = b->stats;
    for (int p = 0; p < HAPI_PRIORITY_COUNT; p++)
        st->queued[p] = b->queue[p].count;
    st->in_flight = b->decoding + ready_total(b);
    st->batch = b->batch;
    st->decoders = (uint64_t)b->decoders_running;
    pthread_mutex_unlock(&b->lock);
}
