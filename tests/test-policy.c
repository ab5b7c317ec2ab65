/* test-policy.c — the choice of split and batch on synthetic profiles; rates; the inputs' table; profile JSON round trip. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "policy.h"

/*
 * A ResNet-50-like profile at 224 (figures of the order measured on a
 * 2-core node): early stages have big outputs, late ones cost the most.
 */
static void resnet_like(hapi_profile *p)
{
    static const struct { const char *name; uint64_t elems; double ms; double mem; } st[] = {
        { "stem", 64 * 56 * 56, 3.0, 4 * 64 * 112 * 112 * 2.0 },
        { "layer1", 256 * 56 * 56, 7.0, 4 * 256 * 56 * 56 * 2.0 },
        { "layer2", 512 * 28 * 28, 8.0, 4 * 512 * 28 * 28 * 2.0 },
        { "layer3", 1024 * 14 * 14, 12.0, 4 * 1024 * 14 * 14 * 2.0 },
        { "layer4", 2048 * 7 * 7, 6.0, 4 * 2048 * 7 * 7 * 2.0 },
        { "pool", 2048, 0.05, 4 * 2048 * 2.0 },
        { "fc", 1000, 0.1, 4 * 1000 * 2.0 },
    };
    memset(p, 0, sizeof(*p));
    p->version = HAPI_PROFILE_VERSION;
    snprintf(p->model_digest, sizeof(p->model_digest), "%032x", 7);
    snprintf(p->device, sizeof(p->device), "cpu");
    p->threads = 2;
    p->cores = 2;
    p->nbatches = 3;
    p->batches[0] = 1, p->batches[1] = 4, p->batches[2] = 16;
    p->nstages = 7;
    for (int i = 0; i < 7; i++) {
        hapi_profile_stage *s = &p->stage[i];
        snprintf(s->name, sizeof(s->name), "%s", st[i].name);
        s->ndim = 1;
        s->shape[0] = (int64_t)st[i].elems;
        s->out_elems = st[i].elems;
        s->param_bytes = 10u << 20;
        for (int k = 0; k < 3; k++)
            s->ms[k] = st[i].ms * (1.0 + 0.1 * k); /* batching does not help here */
        s->mem_fixed = 1 << 20;
        s->mem_per_sample = st[i].mem;
    }
    p->runtime_bytes = 300u << 20;
    p->mem_measured = 1;
    p->sweeps = 3;
}

static hapi_profile prof;

static hapi_policy_input input(double link_bps, double client_speed)
{
    hapi_policy_input in = {
        .profile = &prof,
        .link_bps = link_bps,
        .client_speed = client_speed,
        .mem_budget = 1ull << 30,
        .freeze = 6,
        .epochs = 5,
        .dtype = HAPI_DTYPE_FP16,
        .decode_threads = 1,
        .header_bytes = 128,
        .input_bytes = 3 * 224 * 224 * 4,
        .decode_ms = 2.5,
        .source_bytes = 110000,
        .hit_ms = 0.03,
        .samples = 10000,
    };
    return in;
}

static int choose(const hapi_policy_input *in, hapi_policy_choice *c)
{
    hapi_error err = { 0 };
    int rc = hapi_policy_choose(in, c, &err);
    ck_assert_msg(rc == 0, "choose: %s", err.message);
    return c->split;
}

START_TEST(slow_link_late_split)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    /* 100 Mbit: every early split moves hundreds of KB per sample */
    hapi_policy_input in = input(100e6, 1);
    ck_assert_int_eq(choose(&in, &c), 6);
    ck_assert_str_eq(c.cand[c.index].name, "pool");
    ck_assert_msg(strstr(c.why, "pool") != NULL, "why: %s", c.why);
    /* one epoch only, a fast compute tier and a slower link: still late, the link rules */
    in.epochs = 1;
    in.client_speed = 10;
    in.link_bps = 10e6;
    ck_assert_int_ge(choose(&in, &c), 5);
    /* ... but at 100 Mbit the stem's 400 KB beat 36 ms of storage-side inference */
    in.link_bps = 100e6;
    ck_assert_int_lt(choose(&in, &c), 5);
}
END_TEST

START_TEST(fast_link_slow_storage_early_split)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    /* 100 Gbit, a compute tier 10x faster, one epoch: storage is the bottleneck */
    hapi_policy_input in = input(100e9, 10);
    in.epochs = 1;
    int split = choose(&in, &c);
    ck_assert_msg(split <= 2, "split %d (%s): %s", split, c.cand[c.index].name, c.why);
    ck_assert_str_eq(c.cand[c.index].cold_bound, "storage");
    /* the same with many epochs: the cache makes late splits pay once only */
    in.epochs = 50;
    in.link_bps = 10e9;
    ck_assert_int_ge(choose(&in, &c), 5);
}
END_TEST

/* link_bytes: a split whose .feat outweighs that many source images does not win while one is
   within it; when none is, the fewest bytes win; without a source size there is no bound. */
START_TEST(link_bytes_bounds_the_split)
{
    resnet_like(&prof);
    hapi_policy_choice c, free_choice;
    /* 100 Mbit, a compute tier 10x faster, one epoch: unbounded, an early split wins */
    hapi_policy_input in = input(100e6, 10);
    in.epochs = 1;
    int unbounded = choose(&in, &free_choice);
    ck_assert_int_lt(unbounded, 5);
    ck_assert(free_choice.cand[free_choice.index].within_bytes);
    ck_assert_uint_gt(free_choice.cand[free_choice.index].file_bytes, 110000);

    /* never more than the images: of the frozen splits only pool (4 KB) is within 110 KB */
    in.link_bytes = 1;
    ck_assert_int_eq(choose(&in, &c), 6);
    for (int i = 0; i < c.ncand; i++)
        ck_assert_int_eq(c.cand[i].within_bytes, c.cand[i].file_bytes <= 110000);
    ck_assert(c.raw.within_bytes);
    /* the estimates do not move, only the winner; why says what the bound cost */
    ck_assert_double_eq(c.cand[unbounded - 1].total_s, free_choice.cand[unbounded - 1].total_s);
    ck_assert_double_gt(c.cand[c.index].total_s, c.cand[unbounded - 1].total_s);
    ck_assert_msg(strstr(c.why, "over link_bytes=1") && strstr(c.why,
                  free_choice.cand[free_choice.index].name), "why: %s", c.why);
    ck_assert_msg(strstr(c.why, "pool is the only split within link_bytes=1"), "why: %s", c.why);

    /* a bound the fastest split is within changes nothing */
    in.link_bytes = (double)free_choice.cand[free_choice.index].file_bytes / 110000 + 0.01;
    ck_assert_int_eq(choose(&in, &c), unbounded);
    ck_assert_ptr_null(strstr(c.why, "link_bytes"));

    /* no split within: the fewest bytes (pool), and why says so */
    in.link_bytes = 0.001;
    ck_assert_int_eq(choose(&in, &c), 6);
    ck_assert(!c.cand[c.index].within_bytes);
    ck_assert_msg(strstr(c.why, "No split's .feat is within link_bytes=0.001") &&
                  strstr(c.why, "pool puts the fewest bytes on the link"), "why: %s", c.why);

    /* the images' size unknown: no bound */
    in.link_bytes = 1;
    in.source_bytes = 0;
    ck_assert_int_eq(choose(&in, &c), unbounded);

    /* an operator's split is served whatever the bound */
    in.source_bytes = 110000;
    in.split = 1;
    ck_assert_int_eq(choose(&in, &c), 1);
    ck_assert(!c.cand[c.index].within_bytes);
}
END_TEST

START_TEST(cached_split_preferred)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(100e9, 10);
    in.epochs = 1;
    int early = choose(&in, &c);
    ck_assert_int_lt(early, 6);
    /* everything already cached at the pooling split: nothing to compute there */
    in.cached[6] = 1.0;
    ck_assert_int_eq(choose(&in, &c), 6);
    ck_assert_double_le(c.cand[5].cold_s, c.cand[5].warm_s * 1.0001);
}
END_TEST

START_TEST(never_past_freeze)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    for (int freeze = 1; freeze <= 7; freeze++) {
        for (double link = 1e7; link <= 1e11; link *= 10) {
            hapi_policy_input in = input(link, 1);
            in.freeze = freeze;
            ck_assert_int_le(choose(&in, &c), freeze);
            ck_assert_int_eq(c.ncand, freeze);
        }
    }
    /* an operator's split past the freeze index is refused */
    hapi_policy_input in = input(1e9, 1);
    in.freeze = 4;
    in.split = 5;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_policy_choose(&in, &c, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "freeze"));
}
END_TEST

/* Per-sample time at batches 1, 4, 16 of every stage: f[k] times the stage's batch-1 time. */
static void batch_gain(hapi_profile *p, double f4, double f16)
{
    for (int i = 0; i < p->nstages; i++) {
        double one = p->stage[i].ms[0];
        p->stage[i].ms[1] = one * f4;
        p->stage[i].ms[2] = one * f16;
    }
}

START_TEST(fastest_batch_per_sample)
{
    hapi_policy_choice c;
    hapi_policy_input in = input(1e9, 1);
    in.split = 6;
    resnet_like(&prof);           /* batching costs per sample: batch 1 */
    choose(&in, &c);
    ck_assert_int_eq(c.batch, 1);
    resnet_like(&prof);
    batch_gain(&prof, 0.7, 0.5);  /* keeps gaining: the largest measured, not beyond it */
    choose(&in, &c);
    ck_assert_int_eq(c.batch, 16);
    resnet_like(&prof);
    batch_gain(&prof, 0.6, 0.9);  /* best near 4 (interpolated: 2 is 0.87, 8 is 0.7) */
    choose(&in, &c);
    ck_assert_int_eq(c.batch, 4);
    resnet_like(&prof);
    batch_gain(&prof, 0.80, 0.79); /* 16 gains ~1% on 4: 4 is within 3%, the smallest such */
    choose(&in, &c);
    ck_assert_int_eq(c.batch, 4);
}
END_TEST

START_TEST(memory_caps_batch)
{
    resnet_like(&prof);
    batch_gain(&prof, 0.7, 0.5); /* batching helps: only memory holds it back */
    hapi_policy_choice c;
    hapi_policy_input in = input(1e9, 1);
    in.split = 2; /* layer1: 6.4 MB per sample of working memory */
    in.mem_budget = 1ull << 30;
    choose(&in, &c);
    int roomy = c.batch;
    in.mem_budget = 100ull << 20;
    choose(&in, &c);
    int tight = c.batch;
    ck_assert_int_lt(tight, roomy);
    ck_assert_int_ge(tight, 1);
    ck_assert_double_le(c.cand[1].mem_bytes, (double)in.mem_budget);
    /* the next batch up would not have fitted */
    ck_assert_double_gt(hapi_profile_memory(&prof, 2, tight * 2) + 2.0 * tight * 2 * in.input_bytes,
                        (double)in.mem_budget);
    ck_assert_int_le(roomy, HAPI_POLICY_BATCH_CAP);
    /* a budget that fits nothing: batch 1, and the explanation says so */
    in.mem_budget = 1 << 20;
    in.split = 0;
    choose(&in, &c);
    ck_assert_int_eq(c.batch, 1);
    ck_assert_ptr_nonnull(strstr(c.why, "raise mem"));
    /* a fixed batch is kept */
    in.mem_budget = 1ull << 30;
    in.batch = 3;
    choose(&in, &c);
    ck_assert_int_eq(c.batch, 3);
}
END_TEST

START_TEST(operator_split_explained)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(100e6, 1);
    in.split = 3;
    ck_assert_int_eq(choose(&in, &c), 3);
    ck_assert_ptr_nonnull(strstr(c.why, "operator"));
    ck_assert_ptr_nonnull(strstr(c.why, "pool"));
    char *json = hapi_policy_to_json(&in, &c);
    ck_assert_ptr_nonnull(json);
    ck_assert_ptr_nonnull(strstr(json, "\"candidates\""));
    ck_assert_ptr_nonnull(strstr(json, "\"chosen\": true"));
    free(json);
}
END_TEST

START_TEST(estimates_add_up)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(1e9, 2);
    choose(&in, &c);
    for (int i = 0; i < c.ncand; i++) {
        const hapi_policy_candidate *k = &c.cand[i];
        /* bytes: header + features in fp16 */
        ck_assert_uint_eq(k->file_bytes, 128 + prof.stage[i].out_elems * 2);
        /* link time is bytes over rate */
        ck_assert_double_eq_tol(k->link_ms, (k->file_bytes + HAPI_POLICY_FILE_OVERHEAD) * 8 / 1e9 * 1e3,
                                1e-9);
        /* the compute tier runs the rest of the frozen stages at twice this node's speed */
        ck_assert_double_eq_tol(k->compute_ms, hapi_profile_ms(&prof, k->split, 6, 16) / 2, 1e-9);
        /* cold epoch: the 3-norm of the tiers over all samples, at least the slowest tier
           and at most 3^(1/3) times it (three equal tiers) */
        ck_assert(HAPI_POLICY_COLD_NORM == 3.0);
        double s = k->storage_ms, l = k->link_ms, cm = k->compute_ms;
        double slowest = fmax(s, fmax(l, cm));
        ck_assert_double_eq_tol(k->cold_s, cbrt(s * s * s + l * l * l + cm * cm * cm) * 10000 / 1e3,
                                1e-6);
        ck_assert_double_ge(k->cold_s, slowest * 10000 / 1e3);
        ck_assert_double_le(k->cold_s, cbrt(3) * slowest * 10000 / 1e3);
        ck_assert_double_eq_tol(k->total_s, k->cold_s + 4 * k->warm_s, 1e-6);
        ck_assert_double_le(k->warm_s, k->cold_s + 1e-9);
    }
    /* a cache too small for the pool features of every sample: warm epochs recompute some */
    in.cache_room = 10000 * 4096 / 2;
    choose(&in, &c);
    ck_assert_double_gt(c.cand[5].warm_s, c.cand[5].link_ms * 10000 / 1e3 * 1.5);
}
END_TEST

/* The compute tier's stages as measured there, at its training batch, over client_speed. */
START_TEST(compute_stages_measured)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(100e9, 2);
    in.epochs = 1;
    /* without them, every stage at the profile's largest batch over client_speed */
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[1].compute_ms, hapi_profile_ms(&prof, 2, 6, 16) / 2, 1e-9);
    double raw_trunk = c.raw.compute_ms - in.decode_ms / 2;
    ck_assert_double_eq_tol(raw_trunk, hapi_profile_ms(&prof, 0, 6, 16) / 2, 1e-9);
    /* measured for the first four stages: those are charged as measured, the rest as before */
    static const double ms[] = { 0.5, 0.25, 3.0, 7.0 };
    in.compute_nstages = 4;
    memcpy(in.compute_stage_ms, ms, sizeof(ms));
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[1].compute_ms, 3.0 + 7.0 + hapi_profile_ms(&prof, 4, 6, 16) / 2,
                            1e-9);
    ck_assert_double_eq_tol(c.cand[4].compute_ms, hapi_profile_ms(&prof, 5, 6, 16) / 2, 1e-9);
    ck_assert_double_eq_tol(c.raw.compute_ms - in.decode_ms / 2,
                            0.5 + 0.25 + 3.0 + 7.0 + hapi_profile_ms(&prof, 4, 6, 16) / 2, 1e-9);
    /* a compute tier that runs the trunk far cheaper than its speed says moves the split early */
    in.client_speed = 1;
    in.compute_nstages = 0;
    int late = choose(&in, &c);
    for (int i = 0; i < 6; i++)
        in.compute_stage_ms[i] = prof.stage[i].ms[2] / 20;
    in.compute_nstages = 6;
    int early = choose(&in, &c);
    ck_assert_msg(early < late, "measured stages moved nothing: %d, %d (%s)", early, late, c.why);
    /* in the JSON, as given */
    char *text = hapi_policy_to_json(&in, &c);
    ck_assert_ptr_nonnull(text);
    ck_assert_ptr_nonnull(strstr(text, "\"compute_stages_ms\": ["));
    free(text);
    /* refused: a negative or not-a-number time, too many stages */
    hapi_error err = { 0 };
    in.compute_stage_ms[3] = -1;
    ck_assert_int_eq(hapi_policy_choose(&in, &c, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "compute stage 3"));
    in.compute_stage_ms[3] = NAN;
    ck_assert_int_eq(hapi_policy_choose(&in, &c, &err), HAPI_EINVAL);
    in.compute_stage_ms[3] = 1;
    in.compute_nstages = HAPI_PROFILE_MAX_STAGES + 1;
    ck_assert_int_eq(hapi_policy_choose(&in, &c, &err), HAPI_EINVAL);
}
END_TEST

/* Per file, small features are bound by round trips; packs by bytes, once. */
START_TEST(transport_round_trips_and_packs)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(1e9, 1.0);
    choose(&in, &c);
    const hapi_policy_candidate *last = &c.cand[c.ncand - 1];
    double bytes_ms = ((double)last->file_bytes + HAPI_POLICY_FILE_OVERHEAD) * 8.0 / 1e9 * 1e3;
    ck_assert_double_eq_tol(last->link_file_ms, bytes_ms, 1e-9); /* rtt 0: bytes alone */

    in.rtt_s = 1e-3;
    choose(&in, &c);
    last = &c.cand[c.ncand - 1];
    /* 4 round trips of 1 ms over 8 readers: 0.5 ms per file, far above its bytes */
    ck_assert_double_eq_tol(last->link_file_ms, 0.5, 1e-9);
    ck_assert_double_eq_tol(last->link_ms, last->link_file_ms, 1e-12);
    double feat = (double)last->file_bytes - 128;
    ck_assert_double_eq_tol(last->link_pack_ms,
                            (feat + HAPI_POLICY_PACK_INDEX_BYTES) * 8.0 / 1e9 * 1e3, 1e-9);
    ck_assert(last->link_pack_ms < last->link_file_ms / 10);
    ck_assert(last->total_pack_s < last->total_file_s);
    in.readers = 2;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[c.ncand - 1].link_file_ms, 2.0, 1e-9);

    /* read through packs, the compute node runs [split, freeze) once per sample and later
       epochs are hits there of the freeze point's features: never link-bound, the same at
       every split, and the stages are paid in the first epoch */
    in.transport = HAPI_TRANSPORT_PACK;
    in.compute_file_ms = 1.5, in.compute_load_ns = 20, in.compute_byte_ns = 36;
    choose(&in, &c);
    double warm = fmax(in.hit_ms, 1.5 + (128 + 2048 * 2) * 20 / 1e6) * 10000 / 1e3;
    for (int i = 0; i < c.ncand; i++) {
        const hapi_policy_candidate *k = &c.cand[i];
        ck_assert_double_eq_tol(k->total_s, k->total_pack_s, 1e-9);
        ck_assert_double_eq_tol(k->warm_s, warm, 1e-6);
        ck_assert_str_ne(k->warm_bound, "link");
        double received = ((double)k->file_bytes) * 36 / 1e6;
        ck_assert(k->cold_s >= (k->compute_ms + received + warm * 1e3 / 10000) * 10000 / 1e3 - 1e-6);
    }
    ck_assert(c.cand[0].compute_ms > 10); /* the stem's candidate: layer1..pool on the compute node */
    char *json = hapi_policy_to_json(&in, &c);
    ck_assert_ptr_nonnull(strstr(json, "\"transport\": \"pack\""));
    ck_assert_ptr_nonnull(strstr(json, "\"total_file_s\""));
    free(json);
    in.transport = 7;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_policy_choose(&in, &c, &err), HAPI_EINVAL);
}
END_TEST

/* The link's two terms are shown apart, and the file term is the larger. */
START_TEST(link_terms_apart)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(100e6, 1.0);
    in.rtt_s = 2e-3;
    in.readers = 4;
    choose(&in, &c);
    for (int i = 0; i < c.ncand; i++) {
        const hapi_policy_candidate *k = &c.cand[i];
        ck_assert_double_eq_tol(k->link_bytes_ms,
                                (k->file_bytes + HAPI_POLICY_FILE_OVERHEAD) * 8 / 100e6 * 1e3, 1e-9);
        ck_assert_double_eq_tol(k->link_trips_ms, HAPI_POLICY_FILE_ROUND_TRIPS * 2.0 / 4, 1e-9);
        ck_assert_double_eq_tol(k->link_file_ms, fmax(k->link_bytes_ms, k->link_trips_ms), 1e-12);
    }
    /* stem's 400 KB are bytes-bound, pool's 4 KB round-trip-bound */
    ck_assert_double_gt(c.cand[0].link_bytes_ms, c.cand[0].link_trips_ms);
    ck_assert_double_lt(c.cand[5].link_bytes_ms, c.cand[5].link_trips_ms);
    char *json = hapi_policy_to_json(&in, &c);
    ck_assert_ptr_nonnull(json);
    ck_assert_ptr_nonnull(strstr(json, "\"link_trips_ms\": 2.0"));
    ck_assert_ptr_nonnull(strstr(json, "\"file_round_trips\": 4"));
    free(json);
    /* a request's own time adds to every round trip */
    in.request_ms = 0.5;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].link_trips_ms, HAPI_POLICY_FILE_ROUND_TRIPS * 2.5 / 4, 1e-9);
    in.request_ms = -1;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_policy_choose(&in, &c, &err), HAPI_EINVAL);
}
END_TEST

/* The inputs come back from the policy's JSON: the same choice again, to the byte. */
START_TEST(inputs_json_round_trip)
{
    resnet_like(&prof);
    hapi_policy_choice c, again;
    hapi_policy_input in = input(100e6, 4.0), back;
    hapi_error err = { 0 };
    in.rtt_s = 1e-3;
    in.readers = 2;
    in.decode_threads = 2;
    in.compute_cache = 5e6;
    in.link_bytes = 2.0;
    in.storage_file_ms = 0.25;
    in.storage_serve_ms = 1.5;
    in.compute_file_ms = 1.5;
    in.compute_byte_ns = 36;
    in.compute_load_ns = 20;
    in.request_ms = 0.6;
    in.cache_room = 1u << 30;
    in.compute_nstages = 6;
    for (int i = 0; i < 6; i++)
        in.compute_stage_ms[i] = 0.5 + i;
    for (int s = 1; s <= 6; s++)
        in.cache_entry_bytes[s] = 1000.0 * s;
    in.cached[3] = 0.5;
    choose(&in, &c);
    char *a = hapi_policy_to_json(&in, &c);
    ck_assert_ptr_nonnull(a);
    ck_assert_int_eq(hapi_policy_input_from_json(a, &prof, &back, &err), 0);
    ck_assert_ptr_eq(back.profile, &prof);
    ck_assert_double_eq(back.cached[3], 0.5);
    choose(&back, &again);
    char *b = hapi_policy_to_json(&back, &again);
    ck_assert_str_eq(a, b);
    free(b);

    /* what the operator fixed comes back fixed */
    in.split = 2;
    in.batch = 4;
    choose(&in, &c);
    char *fixed = hapi_policy_to_json(&in, &c);
    ck_assert_int_eq(hapi_policy_input_from_json(fixed, &prof, &back, &err), 0);
    ck_assert_int_eq(back.split, 2);
    ck_assert_int_eq(back.batch, 4);
    free(fixed);

    /* the "inputs" object alone, as a grid cell keeps it; without the fields added later the
       daemon's own header for the profile's output */
    json_t *root = json_loads(a, 0, NULL), *inputs = json_object_get(root, "inputs");
    json_object_del(inputs, "header_bytes");
    char *old = json_dumps(inputs, 0);
    ck_assert_int_eq(hapi_policy_input_from_json(old, &prof, &back, &err), 0);
    ck_assert_uint_eq(back.header_bytes, 128);
    ck_assert_int_eq(back.split, 0);
    ck_assert_double_eq(back.cached[3], 0);
    free(old);

    /* bad input: an error that says what, nothing else */
    json_object_del(inputs, "freeze");
    char *nofreeze = json_dumps(inputs, 0);
    ck_assert_int_eq(hapi_policy_input_from_json(nofreeze, &prof, &back, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "freeze"));
    free(nofreeze);
    json_object_set_new(inputs, "freeze", json_integer(99));
    char *far = json_dumps(inputs, 0);
    ck_assert_int_eq(hapi_policy_input_from_json(far, &prof, &back, &err), HAPI_EINVAL);
    free(far);
    json_object_set_new(inputs, "freeze", json_integer(6));
    json_object_set_new(inputs, "dtype", json_string("int8"));
    char *int8 = json_dumps(inputs, 0);
    ck_assert_int_eq(hapi_policy_input_from_json(int8, &prof, &back, &err), HAPI_EINVAL);
    free(int8);
    ck_assert_int_eq(hapi_policy_input_from_json("{\"inputs\": [", &prof, &back, &err),
                     HAPI_EINVAL);
    json_decref(root);
    free(a);
}
END_TEST

/* What the compute tier keeps in its page cache is not read again: only its open and close. */
START_TEST(compute_cache_spares_later_epochs)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(100e6, 1.0);
    in.rtt_s = 1e-3;
    choose(&in, &c);
    double before = c.cand[5].warm_s;
    ck_assert_double_eq(c.cand[5].compute_kept, 0);
    ck_assert_double_eq_tol(c.cand[5].link_warm_ms, c.cand[5].link_file_ms, 1e-12);

    /* room for half of pool's .feat files of an epoch, and a sliver of stem's */
    in.compute_cache = 0.5 * 10000 * (double)c.cand[5].file_bytes;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].compute_kept, 0.5, 1e-9);
    ck_assert_double_lt(c.cand[0].compute_kept, 0.02);
    double kept_ms = fmax(HAPI_POLICY_KEPT_OVERHEAD * 8 / 100e6 * 1e3,
                          HAPI_POLICY_KEPT_ROUND_TRIPS * 1.0 / HAPI_POLICY_READERS_DEFAULT);
    ck_assert_double_eq_tol(c.cand[5].link_warm_ms,
                            0.5 * kept_ms + 0.5 * c.cand[5].link_file_ms, 1e-9);
    ck_assert_double_lt(c.cand[5].warm_s, before);
    /* the first epoch reads everything whatever the compute tier keeps */
    ck_assert_double_eq_tol(c.cand[5].link_ms, c.cand[5].link_file_ms, 1e-12);

    /* everything kept: a later epoch is bound by the requests sshfs still sends */
    in.compute_cache = 1e15;
    choose(&in, &c);
    for (int i = 0; i < c.ncand; i++) {
        ck_assert_double_eq_tol(c.cand[i].compute_kept, 1.0, 1e-12);
        ck_assert_double_eq_tol(c.cand[i].link_warm_ms, kept_ms, 1e-9);
    }
    /* the raw images too; their reader decodes each image after its wait (2.5 ms here) */
    ck_assert_double_eq_tol(c.raw.compute_kept, 1.0, 1e-12);
    ck_assert_double_eq_tol(c.raw.reader_ms, in.decode_ms, 1e-12);
    ck_assert_double_eq_tol(c.raw.link_warm_ms,
                            (HAPI_POLICY_KEPT_ROUND_TRIPS * 1.0 + in.decode_ms) /
                                HAPI_POLICY_READERS_DEFAULT, 1e-9);

    hapi_error err = { 0 };
    in.compute_cache = -1;
    ck_assert_int_eq(hapi_policy_choose(&in, &c, &err), HAPI_EINVAL);
}
END_TEST

/* The transport's CPU per file loads the tier that pays it, and can make it the bound. */
START_TEST(per_file_transport_cpu)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(10e9, 100.0); /* fast link and compute: storage-bound */
    choose(&in, &c);
    double cold = c.cand[5].cold_s;
    ck_assert_str_eq(c.cand[5].cold_bound, "storage");
    in.storage_file_ms = 2.0;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].cold_s, cold + 2.0 * 10000 / 1e3, 1e-6);
    /* on the compute tier: a fast one fed tiny features waits for the files */
    in.storage_file_ms = 0;
    in.compute_file_ms = 50.0;
    choose(&in, &c);
    ck_assert_str_eq(c.cand[5].cold_bound, "compute");
    /* computed on demand, the first epoch is the tiers' 3-norm, not the compute tier alone */
    double s = c.cand[5].storage_ms, l = c.cand[5].link_file_ms, k = c.cand[5].compute_ms + 50.0;
    ck_assert_double_eq_tol(c.cand[5].cold_s, cbrt(s * s * s + l * l * l + k * k * k) * 10000 / 1e3,
                            1e-6);
    ck_assert_double_gt(c.cand[5].cold_s, k * 10000 / 1e3 * 1.01);
    /* all of it cached: nothing to wait for, the slowest tier */
    in.cached[6] = 1.0;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].cold_s, fmax(in.hit_ms, k) * 10000 / 1e3, 1e-6);
    in.cached[6] = 0;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.raw.cold_s, fmax(c.raw.link_ms, c.raw.compute_ms + 50.0) * 10000 / 1e3,
                            1e-6);
    /* a feature computed on demand costs its serving in the first epoch, not once cached */
    in.compute_file_ms = 0;
    choose(&in, &c);
    double warm = c.cand[5].warm_s;
    in.storage_serve_ms = 1.5;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].cold_s, cold + 1.5 * 10000 / 1e3, 1e-6);
    ck_assert_double_eq_tol(c.cand[5].warm_s, warm, 1e-9);
    /* bytes received cost the compute tier in every epoch that reads them across the link:
       the first, and the later ones for what its page cache did not keep */
    in.storage_serve_ms = 0;
    in.client_speed = 1;
    in.compute_byte_ns = 1000; /* 1 us a byte: stem's 400 KB files take 400 ms each */
    choose(&in, &c);
    double received = (double)c.cand[0].file_bytes * 1e-3;
    ck_assert_str_eq(c.cand[0].cold_bound, "compute");
    /* the compute tier dwarfs the others: the first epoch's 3-norm is within 0.1% of it */
    ck_assert_double_eq_tol(c.cand[0].warm_s, (c.cand[0].compute_ms + received) * 10000 / 1e3, 1e-6);
    ck_assert_double_ge(c.cand[0].cold_s, c.cand[0].warm_s);
    ck_assert_double_le(c.cand[0].cold_s, c.cand[0].warm_s * 1.001);
    in.compute_cache = 1e15; /* it keeps every file: later epochs receive nothing */
    choose(&in, &c);
    ck_assert_double_lt(c.cand[0].warm_s, c.cand[0].cold_s - received * 10000 / 1e3 * 0.99);
    /* loading a file costs every epoch, kept or not */
    in.compute_byte_ns = 0;
    in.compute_load_ns = 1000;
    choose(&in, &c);
    ck_assert_str_eq(c.cand[0].warm_bound, "compute");
    ck_assert_double_eq_tol(c.cand[0].warm_s, (c.cand[0].compute_ms + received) * 10000 / 1e3, 1e-6);
    ck_assert_double_eq_tol(c.cand[0].reader_ms, received, 1e-9);
    hapi_error err = { 0 };
    in.compute_load_ns = -1;
    ck_assert_int_eq(hapi_policy_choose(&in, &c, &err), HAPI_EINVAL);
}
END_TEST

/* A reader waits for its file, then works on it: with few readers and a long RTT the two add. */
START_TEST(readers_wait_then_work)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(10e9, 100.0);
    in.rtt_s = 1e-3;
    in.request_ms = 0.6;
    in.readers = 2;
    in.compute_file_ms = 0;
    choose(&in, &c);
    double trips = c.cand[5].link_trips_ms;
    ck_assert_double_eq_tol(trips, HAPI_POLICY_FILE_ROUND_TRIPS * 1.6 / 2, 1e-9);
    in.compute_file_ms = 1.5;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].reader_ms, 1.5, 1e-9);
    ck_assert_double_eq_tol(c.cand[5].link_trips_ms, trips + 1.5 / 2, 1e-9);
    /* the later epoch's kept files: their requests and the reader's work */
    in.compute_cache = 1e15;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].link_warm_ms,
                            (HAPI_POLICY_KEPT_ROUND_TRIPS * 1.6 + 1.5) / 2, 1e-9);
    ck_assert_str_eq(c.cand[5].warm_bound, "link");
}
END_TEST

/* Under a CFS quota a hit and the transport's work per file take longer: warm epochs show it. */
START_TEST(quota_slows_serving)
{
    resnet_like(&prof);
    hapi_policy_choice c;
    hapi_policy_input in = input(10e9, 100.0);
    in.storage_file_ms = 0.3;
    in.compute_file_ms = 0;
    in.epochs = 2;
    choose(&in, &c);
    double warm = c.cand[5].warm_s, raw_storage = c.raw.storage_ms;
    ck_assert_double_eq_tol(warm, (0.03 + 0.3) * 10000 / 1e3, 1e-6);
    prof.cpu_quota = 0.25;
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].warm_s, 4 * warm, 1e-6);
    ck_assert_double_eq_tol(c.raw.storage_ms, 4 * raw_storage, 1e-9);
    prof.cpu_quota = 3; /* more than a CPU: one thread's work is no slower */
    choose(&in, &c);
    ck_assert_double_eq_tol(c.cand[5].warm_s, warm, 1e-6);
}
END_TEST

static void put(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

/* The quota read from cgroup v1 (cpu hierarchy) and v2 (cpu.max), the least up the tree. */
START_TEST(cpu_quota_from_cgroups)
{
    char root[] = "/tmp/hapi-test-cgroup-XXXXXX", d[512];
    ck_assert_ptr_nonnull(mkdtemp(root));
    /* v1: the group has no quota of its own, its parent a quarter of a CPU */
    snprintf(d, sizeof(d), "%s/cpu", root), mkdir(d, 0755);
    snprintf(d, sizeof(d), "%s/cpu/tier", root), mkdir(d, 0755);
    put(d, "cpu.cfs_quota_us", "25000\n");
    put(d, "cpu.cfs_period_us", "100000\n");
    snprintf(d, sizeof(d), "%s/cpu/tier/storage", root), mkdir(d, 0755);
    put(d, "cpu.cfs_quota_us", "-1\n");
    put(d, "cpu.cfs_period_us", "100000\n");
    put(root, "self-v1", "5:memory:/elsewhere\n3:cpu,cpuacct:/tier/storage\n0::/\n");
    char self[600];
    snprintf(self, sizeof(self), "%s/self-v1", root);
    ck_assert_double_eq_tol(hapi_cpu_quota(self, root), 0.25, 1e-12);
    /* v2: cpu.max in the unified tree; the group's own 1.5 CPUs under an unlimited parent */
    snprintf(d, sizeof(d), "%s/svc", root), mkdir(d, 0755);
    put(d, "cpu.max", "max 100000\n");
    snprintf(d, sizeof(d), "%s/svc/hapifs", root), mkdir(d, 0755);
    put(d, "cpu.max", "150000 100000\n");
    put(root, "self-v2", "0::/svc/hapifs\n");
    snprintf(self, sizeof(self), "%s/self-v2", root);
    ck_assert_double_eq_tol(hapi_cpu_quota(self, root), 1.5, 1e-12);
    /* no quota anywhere, and nothing to read */
    put(d, "cpu.max", "max 100000\n");
    ck_assert_double_eq(hapi_cpu_quota(self, root), 0);
    ck_assert_double_eq(hapi_cpu_quota("/nonexistent/cgroup", root), 0);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* The text of x in the unit an input's parser reads bare or by its base unit. */
static void base_text(const hapi_policy_input_spec *s, double x, char *buf, size_t size)
{
    if (s->kind == HAPI_INPUT_RATE)
        snprintf(buf, size, "%.17gbit/s", x);
    else if (s->kind == HAPI_INPUT_TIME)
        snprintf(buf, size, "%.17gs", x);
    else if (s->kind == HAPI_INPUT_SIZE || s->kind == HAPI_INPUT_INT)
        snprintf(buf, size, "%.0f", x);
    else
        snprintf(buf, size, "%.17g", x);
}

/* Every input parses both ends of its range as written and refuses just past them, with a
   message that names the input, the value and the range. */
START_TEST(inputs_boundaries)
{
    size_t n;
    const hapi_policy_input_spec *specs = hapi_policy_input_specs(&n);
    ck_assert_uint_ge(n, 9);
    hapi_policy_input_value v;
    hapi_error err;
    for (size_t i = 0; i < n; i++) {
        const hapi_policy_input_spec *s = &specs[i];
        ck_assert_ptr_eq(hapi_policy_input_find(s->name), s);
        ck_assert(s->meaning && *s->meaning && s->why && *s->why && s->unit && s->range);
        if (s->kind == HAPI_INPUT_ENUM) {
            char word[64];
            int index = 0;
            for (const char *w = s->words; *w; index++) {
                size_t len = strcspn(w, "|");
                snprintf(word, sizeof(word), "%.*s", (int)len, w);
                ck_assert_int_eq(hapi_policy_input_parse(s->name, word, &v, &err), 0);
                ck_assert_double_eq(v.number, index);
                w += len + (w[len] == '|');
            }
            ck_assert_int_eq(hapi_policy_input_parse(s->name, "", &v, &err), HAPI_EINVAL);
            snprintf(word, sizeof(word), "%sx", s->range);
            ck_assert_int_eq(hapi_policy_input_parse(s->name, word, &v, &err), HAPI_EINVAL);
            ck_assert_ptr_nonnull(strstr(err.message, s->range));
            continue;
        }
        /* the range's ends as README.md and the man pages write them */
        const char *dots = strstr(s->range, "..");
        ck_assert_ptr_nonnull(dots);
        char lo[64], hi[64], text[80];
        snprintf(lo, sizeof(lo), "%.*s", (int)(dots - s->range), s->range);
        snprintf(hi, sizeof(hi), "%s", dots + 2);
        ck_assert_msg(hapi_policy_input_parse(s->name, lo, &v, &err) == 0, "%s %s: %s", s->name,
                      lo, err.message);
        ck_assert_double_eq(s->kind == HAPI_INPUT_MS_LIST ? v.list[0] : v.number, s->min);
        ck_assert_msg(hapi_policy_input_parse(s->name, hi, &v, &err) == 0, "%s %s: %s", s->name,
                      hi, err.message);
        ck_assert_double_eq(s->kind == HAPI_INPUT_MS_LIST ? v.list[0] : v.number, s->max);
        /* ... and just outside them: a whole unit for counts and bytes, else a millionth */
        int whole = s->kind == HAPI_INPUT_INT || s->kind == HAPI_INPUT_SIZE;
        double below = whole ? s->min - 1 : s->min == 0 ? -1e-6 : s->min * (1 - 1e-6);
        double above = whole ? s->max + 1 : s->max * (1 + 1e-6);
        double outside[] = { below, above };
        for (int k = 0; k < 2; k++) {
            base_text(s, outside[k], text, sizeof(text));
            ck_assert_msg(hapi_policy_input_parse(s->name, text, &v, &err) == HAPI_EINVAL,
                          "%s %s taken", s->name, text);
            char head[160];
            snprintf(head, sizeof(head), "%s %s: ", s->name, text);
            ck_assert_msg(strncmp(err.message, head, strlen(head)) == 0, "%s", err.message);
            ck_assert_msg(strstr(err.message, s->range), "%s", err.message);
        }
        if (s->words) {
            ck_assert_int_eq(hapi_policy_input_parse(s->name, s->words, &v, &err), 0);
            ck_assert_int_eq(v.is_word, 1);
            ck_assert_int_eq(v.count, 0);
        }
        ck_assert_int_eq(hapi_policy_input_parse(s->name, "", &v, &err), HAPI_EINVAL);
        ck_assert_int_eq(hapi_policy_input_parse(s->name, "x", &v, &err), HAPI_EINVAL);
    }
    ck_assert_ptr_null(hapi_policy_input_find("frobnicate"));
    ck_assert_int_eq(hapi_policy_input_parse("frobnicate", "1", &v, &err), HAPI_EINVAL);
}
END_TEST

/* Each input's fallback parses to the default the policy takes, and its help line (what
   hapifs --help prints) states its range, unit and fallback as the table has them. */
START_TEST(inputs_fallbacks_and_help)
{
    static const struct { const char *name; double number; } defaults[] = {
        { "link", HAPI_POLICY_LINK_DEFAULT }, { "rtt", 0 },
        { "transport", HAPI_TRANSPORT_FILE }, { "client_speed", 1 },
        { "compute_file_ms", HAPI_POLICY_COMPUTE_FILE_MS },
        { "epochs", HAPI_POLICY_EPOCHS_DEFAULT }, { "compute_cache", 0 },
        { "readers", HAPI_POLICY_READERS_DEFAULT },
        { "link_bytes", HAPI_POLICY_LINK_BYTES_DEFAULT },
    };
    size_t n;
    const hapi_policy_input_spec *specs = hapi_policy_input_specs(&n);
    hapi_policy_input_value v;
    hapi_error err;
    for (size_t i = 0; i < n; i++) {
        const hapi_policy_input_spec *s = &specs[i];
        ck_assert_msg(s->value && *s->value && s->fallback && *s->fallback, "%s", s->name);
        ck_assert_msg(hapi_policy_input_parse(s->name, s->fallback, &v, &err) == 0, "%s: %s",
                      s->name, err.message);
        if (strcmp(s->name, "compute_stages") == 0) {
            ck_assert(v.is_word && v.count == 0); /* none: every stage at client_speed */
            continue;
        }
        size_t k = 0;
        while (k < sizeof(defaults) / sizeof(*defaults) && strcmp(defaults[k].name, s->name))
            k++;
        ck_assert_msg(k < sizeof(defaults) / sizeof(*defaults), "%s: no default known", s->name);
        ck_assert_double_eq(v.number, defaults[k].number);
        char help[512];
        int len = hapi_policy_input_help(s, help, sizeof(help));
        ck_assert_int_eq(len, (int)strlen(help));
        ck_assert_msg(strstr(help, s->meaning) == help, "%s", help);
        if (s->kind != HAPI_INPUT_ENUM)
            ck_assert_msg(strstr(help, s->range), "%s", help);
    }
    char help[512];
    ck_assert_int_gt(hapi_policy_input_help(hapi_policy_input_find("epochs"), help,
                                            sizeof(help)), 0);
    ck_assert_str_eq(help, "epochs a job is expected to read: 1..100000 epochs (default 5)");
    hapi_policy_input_help(hapi_policy_input_find("link"), help, sizeof(help));
    ck_assert_str_eq(help, "the link's rate to the compute tier: 1kbit/s..10Tbit/s (default 1Gbit)");
    hapi_policy_input_help(hapi_policy_input_find("compute_file_ms"), help, sizeof(help));
    ck_assert_ptr_nonnull(strstr(help, ": 0..1000 ms, or default (default 1.5)"));
    hapi_policy_input_help(hapi_policy_input_find("client_speed"), help, sizeof(help));
    ck_assert_ptr_nonnull(strstr(help, ": 0.001..10000 times (default 1)"));
    hapi_policy_input_help(hapi_policy_input_find("transport"), help, sizeof(help));
    ck_assert_ptr_nonnull(strstr(help, "(-o remote) (default file)"));
    /* cut to the buffer, the whole length returned */
    int whole = hapi_policy_input_help(hapi_policy_input_find("link"), help, 8);
    ck_assert_str_eq(help, "the lin");
    ck_assert_int_eq(whole, (int)strlen("the link's rate to the compute tier: "
                                        "1kbit/s..10Tbit/s (default 1Gbit)"));
}
END_TEST

/* The messages users see, the same from a mount option, ctl and hapifs-ctl. */
START_TEST(inputs_messages)
{
    hapi_policy_input_value v;
    hapi_error err;
    ck_assert_int_eq(hapi_policy_input_parse("epochs", "0", &v, &err), HAPI_EINVAL);
    ck_assert_str_eq(err.message, "epochs 0: expected a whole number in 1..100000");
    ck_assert_int_eq(hapi_policy_input_parse("epochs", "1.5", &v, &err), HAPI_EINVAL);
    ck_assert_int_eq(hapi_policy_input_parse("epochs", "7", &v, &err), 0);
    ck_assert_double_eq(v.number, 7);
    ck_assert_int_eq(hapi_policy_input_parse("link", "100", &v, &err), HAPI_EINVAL);
    ck_assert_str_eq(err.message, "link 100: no unit, bits or bytes?; expected a link rate in "
                                  "1kbit/s..10Tbit/s, e.g. 1Gbit or 125MB/s");
    ck_assert_int_eq(hapi_policy_input_parse("link", "100mbps", &v, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "ambiguous"));
    ck_assert_int_eq(hapi_policy_input_parse("link", "1Gfoo", &v, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "link 1Gfoo: unknown unit 'Gfoo'; expected"));
    ck_assert_int_eq(hapi_policy_input_parse("link", "125MB/s", &v, &err), 0);
    ck_assert_double_eq(v.number, 1e9);
    ck_assert_int_eq(hapi_policy_input_parse("rtt", "200us", &v, &err), 0);
    ck_assert_double_eq_tol(v.number, 200e-6, 1e-15);
    ck_assert_int_eq(hapi_policy_input_parse("compute_file_ms", "nan", &v, &err), HAPI_EINVAL);
    ck_assert_str_eq(err.message, "compute_file_ms nan: expected a number in 0..1000 (ms), or "
                                  "default");
    ck_assert_int_eq(hapi_policy_input_parse("compute_file_ms", "default", &v, &err), 0);
    ck_assert_int_eq(v.is_word, 1);
    ck_assert_double_eq(v.number, -1);
    ck_assert_int_eq(hapi_policy_input_parse("transport", "pack", &v, &err), 0);
    ck_assert_double_eq(v.number, HAPI_TRANSPORT_PACK);
    ck_assert_int_eq(hapi_policy_input_parse("transport", "bulk", &v, &err), HAPI_EINVAL);
    ck_assert_str_eq(err.message, "transport bulk: expected file|pack");
    ck_assert_int_eq(hapi_policy_input_parse("compute_cache", "8G", &v, &err), 0);
    ck_assert_double_eq(v.number, 8.0 * 1073741824);
    /* compute_stages: a list, each in range, at most a profile's stages */
    ck_assert_int_eq(hapi_policy_input_parse("compute_stages", "0.8,2.1,3.4", &v, &err), 0);
    ck_assert_int_eq(v.count, 3);
    ck_assert_double_eq(v.list[2], 3.4);
    ck_assert_int_eq(hapi_policy_input_parse("compute_stages", "0.8,,3.4", &v, &err),
                     HAPI_EINVAL);
    ck_assert_int_eq(hapi_policy_input_parse("compute_stages", "0.8,", &v, &err), HAPI_EINVAL);
    ck_assert_int_eq(hapi_policy_input_parse("compute_stages", "1,60001", &v, &err),
                     HAPI_EINVAL);
    char many[4 * (HAPI_PROFILE_MAX_STAGES + 1)] = "1";
    for (int i = 1; i < HAPI_PROFILE_MAX_STAGES; i++)
        strcat(many, ",1");
    ck_assert_int_eq(hapi_policy_input_parse("compute_stages", many, &v, &err), 0);
    ck_assert_int_eq(v.count, HAPI_PROFILE_MAX_STAGES);
    strcat(many, ",1");
    ck_assert_int_eq(hapi_policy_input_parse("compute_stages", many, &v, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "more than 64 stages"));
}
END_TEST

START_TEST(rates)
{
    double bps;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_policy_parse_rate("1Gbit", &bps, &err), 0);
    ck_assert_double_eq(bps, 1e9);
    ck_assert_int_eq(hapi_policy_parse_rate("100mbit", &bps, &err), 0);
    ck_assert_double_eq(bps, 100e6);
    ck_assert_int_eq(hapi_policy_parse_rate("10 Gbit/s", &bps, &err), 0);
    ck_assert_double_eq(bps, 10e9);
    ck_assert_int_eq(hapi_policy_parse_rate("125MB/s", &bps, &err), 0);
    ck_assert_double_eq(bps, 1e9);
    ck_assert_int_eq(hapi_policy_parse_rate("1MiB/s", &bps, &err), 0);
    ck_assert_double_eq(bps, 8.0 * 1048576);
    ck_assert_int_eq(hapi_policy_parse_rate("1.5kbit", &bps, &err), 0);
    ck_assert_double_eq(bps, 1500);
    ck_assert_int_eq(hapi_policy_parse_rate("1000", &bps, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "no unit"));
    ck_assert_int_eq(hapi_policy_parse_rate("100mbps", &bps, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "ambiguous"));
    ck_assert_int_eq(hapi_policy_parse_rate("fast", &bps, &err), HAPI_EINVAL);
    ck_assert_int_eq(hapi_policy_parse_rate("-1Gbit", &bps, &err), HAPI_EINVAL);
    ck_assert_int_eq(hapi_policy_parse_rate("1Gfoo", &bps, &err), HAPI_EINVAL);
    ck_assert_int_eq(hapi_policy_parse_rate("", &bps, &err), HAPI_EINVAL);
    char buf[32];
    hapi_policy_format_rate(1e9, buf, sizeof(buf));
    ck_assert_str_eq(buf, "1 Gbit/s");
    hapi_policy_format_rate(100e6, buf, sizeof(buf));
    ck_assert_str_eq(buf, "100 Mbit/s");
}
END_TEST

START_TEST(profile_round_trip)
{
    resnet_like(&prof);
    prof.cpu_quota = 0.5;
    char *json = hapi_profile_to_json(&prof);
    ck_assert_ptr_nonnull(json);
    hapi_profile back;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_profile_from_json(json, &back, &err), 0);
    ck_assert_int_eq(back.nstages, prof.nstages);
    ck_assert_int_eq(back.nbatches, 3);
    for (int i = 0; i < prof.nstages; i++) {
        ck_assert_str_eq(back.stage[i].name, prof.stage[i].name);
        ck_assert_uint_eq(back.stage[i].out_elems, prof.stage[i].out_elems);
        ck_assert_double_eq_tol(back.stage[i].ms[2], prof.stage[i].ms[2], 1e-9);
        ck_assert_double_eq_tol(back.stage[i].mem_per_sample, prof.stage[i].mem_per_sample, 1e-3);
    }
    ck_assert_int_eq(back.sweeps, prof.sweeps);
    ck_assert_double_eq_tol(back.cpu_quota, prof.cpu_quota, 1e-12);
    /* stored and read back from a file */
    char path[] = "/tmp/hapi-test-profile-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    ck_assert_int_eq(hapi_profile_save(path, &prof, &err), 0);
    ck_assert_int_eq(hapi_profile_load(path, &back, &err), 0);
    ck_assert_str_eq(back.model_digest, prof.model_digest);
    unlink(path);
    /* damaged text is refused with a reason */
    ck_assert_int_eq(hapi_profile_from_json("{\"version\": 1}", &back, &err), HAPI_EINVAL);
    ck_assert_int_eq(hapi_profile_from_json("not json", &back, &err), HAPI_EINVAL);
    json[strlen(json) / 2] = '\0';
    ck_assert_int_eq(hapi_profile_from_json(json, &back, &err), HAPI_EINVAL);
    free(json);
    ck_assert_int_eq(hapi_profile_load("/nonexistent/profile.json", &back, &err), -ENOENT);
}
END_TEST

START_TEST(sweeps_until_settled)
{
    const double B = HAPI_PROFILE_BUDGET_S;
    /* one sweep is never the figure, even one that took the whole budget (a slow start) */
    ck_assert(hapi_profile_sweep_again(1, 1, 12.0, 12.0));
    ck_assert(hapi_profile_sweep_again(1, 1, B + 5, B + 5));
    /* from the second on, only while another fits the budget */
    ck_assert(hapi_profile_sweep_again(2, 1, 10.0, 4.0));
    ck_assert(hapi_profile_sweep_again(2, 1, B - 4, 4.0));
    ck_assert(!hapi_profile_sweep_again(2, 1, B - 4, 4.5));
    ck_assert(!hapi_profile_sweep_again(3, 1, 17.0, 4.0));
    /* settled: a sweep that lowered nothing by more than 5% ends it */
    ck_assert(!hapi_profile_sweep_again(2, 0, 1.0, 0.5));
    /* and never past the most sweeps */
    ck_assert(hapi_profile_sweep_again(HAPI_PROFILE_MAX_SWEEPS - 1, 1, 1.0, 0.1));
    ck_assert(!hapi_profile_sweep_again(HAPI_PROFILE_MAX_SWEEPS, 1, 1.0, 0.1));
}
END_TEST

START_TEST(interpolation)
{
    resnet_like(&prof);
    /* stage 0: 3.0, 3.3, 3.6 ms at batches 1, 4, 16 */
    ck_assert_double_eq_tol(hapi_profile_ms(&prof, 0, 1, 1), 3.0, 1e-9);
    ck_assert_double_eq_tol(hapi_profile_ms(&prof, 0, 1, 10), 3.3 + 0.3 * 6 / 12, 1e-9);
    ck_assert_double_eq_tol(hapi_profile_ms(&prof, 0, 1, 64), 3.6, 1e-9);
    ck_assert_double_eq_tol(hapi_profile_ms(&prof, 0, 7, 1), 36.15, 1e-9);
    /* memory: weights of the stages run plus the worst stage's working memory */
    double m = hapi_profile_memory(&prof, 2, 4);
    ck_assert_double_eq_tol(m, 2 * (10 << 20) + (1 << 20) + 4 * (4 * 256 * 56 * 56 * 2.0), 1);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("policy");
    TCase *tc = tcase_create("choice");
    tcase_add_test(tc, slow_link_late_split);
    tcase_add_test(tc, fast_link_slow_storage_early_split);
    tcase_add_test(tc, link_bytes_bounds_the_split);
    tcase_add_test(tc, cached_split_preferred);
    tcase_add_test(tc, never_past_freeze);
    tcase_add_test(tc, memory_caps_batch);
    tcase_add_test(tc, fastest_batch_per_sample);
    tcase_add_test(tc, operator_split_explained);
    tcase_add_test(tc, estimates_add_up);
    tcase_add_test(tc, compute_stages_measured);
    tcase_add_test(tc, transport_round_trips_and_packs);
    tcase_add_test(tc, link_terms_apart);
    tcase_add_test(tc, inputs_json_round_trip);
    tcase_add_test(tc, compute_cache_spares_later_epochs);
    tcase_add_test(tc, per_file_transport_cpu);
    tcase_add_test(tc, readers_wait_then_work);
    tcase_add_test(tc, quota_slows_serving);
    suite_add_tcase(s, tc);
    TCase *tp = tcase_create("profile");
    tcase_add_test(tp, rates);
    tcase_add_test(tp, cpu_quota_from_cgroups);
    tcase_add_test(tp, profile_round_trip);
    tcase_add_test(tp, interpolation);
    tcase_add_test(tp, sweeps_until_settled);
    suite_add_tcase(s, tp);
    TCase *ti = tcase_create("inputs");
    tcase_add_test(ti, inputs_boundaries);
    tcase_add_test(ti, inputs_messages);
    tcase_add_test(ti, inputs_fallbacks_and_help);
    suite_add_tcase(s, ti);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
