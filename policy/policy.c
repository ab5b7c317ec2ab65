/* policy.c — the choice of split and batch from a profile, the link and the memory budget, and why. */
#include "policy.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------- choice */

static double max3(double a, double b, double c)
{
    double m = a > b ? a : b;
    return m > c ? m : c;
}

/* The per-file time of a first epoch read a file at a time, of which computed (0..1) is
   computed on demand: HAPI_POLICY_COLD_NORM's norm of its tiers' times for what is computed
   (policy.h says why), their maximum for what is cached (nothing to wait for). */
static double cold_file_ms(double storage, double link, double compute, double computed)
{
    double p = HAPI_POLICY_COLD_NORM, m = max3(storage, link, compute);
    if (!(m > 0))
        return 0;
    /* scaled by the largest, so that no power overflows */
    double norm = m * pow(pow(storage / m, p) + pow(link / m, p) + pow(compute / m, p), 1 / p);
    return m + computed * (norm - m);
}

static const char *bound_of(double storage, double link, double compute)
{
    if (storage >= link && storage >= compute)
        return "storage";
    return link >= compute ? "link" : "compute";
}

/* Storage-side memory at split and batch: the model's part and two batches of input tensors. */
static double memory_at(const hapi_policy_input *in, int split, int batch)
{
    return hapi_profile_memory(in->profile, split, batch) + 2.0 * batch * (double)in->input_bytes;
}

/*
 * batch=auto: the batch with the least time per sample among those that fit the budget (powers
 * of two up to the cap, timed by interpolating the profile's measured batches), and of those
 * within 3% of it the smallest: a bigger batch that gains nothing only adds latency and memory.
 * On CPUs the fastest is not always the largest (activations falling out of cache); ResNet-50
 * at 224 px, 1 thread: 16-17 img/s at batch 1, 18 at 32 with the heap kept (design.md, "The
 * heap"), 3.7 at 32 without.
 */
static int pick_batch(const hapi_policy_input *in, int split)
{
    if (in->batch > 0)
        return in->batch;
    double ms[16];
    int batches[16], n = 0;
    for (int b = 1; b <= HAPI_POLICY_BATCH_CAP && n < 16; b *= 2) {
        if (b > 1 && in->mem_budget && memory_at(in, split, b) > (double)in->mem_budget)
            break;
        batches[n] = b;
        ms[n++] = hapi_profile_ms(in->profile, 0, split, b);
    }
    double best = ms[0];
    for (int k = 1; k < n; k++)
        if (ms[k] < best)
            best = ms[k];
    for (int k = 0; k < n; k++)
        if (ms[k] <= best * 1.03)
            return batches[k];
    return 1;
}

/*
 * What moving one sample costs on the link, by transport, in ms. Every
 * transport has the same terms, so that another (a bulk path reading many
 * files per request) is one more case here:
 *  - bytes: the file and its protocol overhead over the link's rate;
 *  - round trips: those of one file, each the RTT and the request's own
 *    time, and the reader's own work on the file (reader_ms), spread over the
 *    concurrent readers: a reader (a DataLoader worker) waits for a file and
 *    then works on it, one after the other (measured through sshfs at 1 ms
 *    RTT: the round trips bound small files, and a later epoch's kept files
 *    took the sum of the two, not the larger);
 *  - a later epoch: what the compute tier kept in its cache costs only the
 *    requests still sent for it (sshfs opens and closes a cached file).
 * Per file the bytes and the round trips overlap (other readers' requests fill
 * the link while one waits): the larger of the two. In a pack: the row and
 * its index entry; a chunk's round trip is spread over hundreds of rows, and a
 * later epoch is a hit in the compute-side hapifs's cache (no link at all) of
 * the freeze point's feature, which that mount computed once (estimate()).
 */
struct link_cost {
    double bytes_ms, trips_ms; /* per file, the two terms */
    double file_ms;            /* per file: max(bytes, trips) */
    double kept_ms;            /* per file the compute tier kept: its requests alone */
    double pack_ms;            /* per row of a pack */
};

static struct link_cost link_terms(const hapi_policy_input *in, double file_bytes,
                                   double header_bytes, double reader_ms, double reader_kept_ms)
{
    struct link_cost c;
    int readers = in->readers > 0 ? in->readers : HAPI_POLICY_READERS_DEFAULT;
    double ms_per_byte = 8.0 / in->link_bps * 1e3;
    c.bytes_ms = (file_bytes + HAPI_POLICY_FILE_OVERHEAD) * ms_per_byte;
    double trip_ms = in->rtt_s * 1e3 + in->request_ms;
    c.trips_ms = (HAPI_POLICY_FILE_ROUND_TRIPS * trip_ms + reader_ms) / readers;
    c.file_ms = fmax(c.bytes_ms, c.trips_ms);
    c.kept_ms = fmax(HAPI_POLICY_KEPT_OVERHEAD * ms_per_byte,
                     (HAPI_POLICY_KEPT_ROUND_TRIPS * trip_ms + reader_kept_ms) / readers);
    c.pack_ms = (file_bytes - header_bytes + HAPI_POLICY_PACK_INDEX_BYTES) * ms_per_byte;
    return c;
}

/* The fraction of an epoch's files of file_bytes each that the compute tier's cache keeps. */
static double compute_kept(const hapi_policy_input *in, double file_bytes, double samples)
{
    if (!(in->compute_cache > 0))
        return 0;
    double need = samples * file_bytes;
    return need > 0 ? fmin(1.0, in->compute_cache / need) : 1.0;
}

/*
 * A reader's own work on a file of bytes after its wait for it, in ms: the training loop's per
 * file (compute_file_ms), its bytes loaded in every epoch (compute_load_ns: numpy.load, fp16
 * to fp32, collation) and received when it crosses the link (compute_byte_ns, given back in
 * *received: a later epoch does not pay it for what the compute tier kept).
 */
static double reader_cost(const hapi_policy_input *in, double bytes, double *received)
{
    *received = bytes * in->compute_byte_ns / 1e6;
    return in->compute_file_ms + bytes * in->compute_load_ns / 1e6 + *received;
}

/*
 * With packs, a reader's own work per sample in every epoch, in ms: a freeze-point file out of
 * the compute node's cache (what reader_cost() charges, less the bytes received: a pack's
 * rows are received by the compute-side daemon, once).
 */
static double pack_reader_ms(const hapi_policy_input *in)
{
    const hapi_profile_stage *f = &in->profile->stage[in->freeze - 1];
    double bytes = in->header_bytes + (double)f->out_elems * (in->dtype == HAPI_DTYPE_FP16 ? 2 : 4);
    double received;
    return reader_cost(in, bytes, &received) - received;
}

/* How much slower than a whole CPU this node's cgroup quota makes one thread (1: no quota). */
static double storage_slowdown(const hapi_profile *p)
{
    return p->cpu_quota > 0 && p->cpu_quota < 1 ? 1 / p->cpu_quota : 1;
}

/*
 * Stages [from, to) on the compute tier, ms per sample: as measured there at its training batch
 * (compute_stage_ms), else the profile's time at its largest batch over client_speed. The
 * profile's largest batch may be far from the training loop's: under a CPU quota the profile
 * stops at batch 4 (HAPI_PROFILE_BUDGET_S), where VGG-16's fc6 costs 2.3x a sample what it does
 * at 16 (design.md, "The compute tier's stages").
 */
static double compute_stages_ms(const hapi_policy_input *in, int from, int to)
{
    const hapi_profile *p = in->profile;
    int batch = p->batches[p->nbatches - 1];
    double ms = 0;
    for (int i = from; i < to; i++)
        ms += i < in->compute_nstages ? in->compute_stage_ms[i]
                                      : hapi_profile_ms(p, i, i + 1, batch) / in->client_speed;
    return ms;
}

static void estimate(const hapi_policy_input *in, int split, hapi_policy_candidate *c,
                     double samples)
{
    const hapi_profile *p = in->profile;
    const hapi_profile_stage *s = &p->stage[split - 1];

    memset(c, 0, sizeof(*c));
    c->split = split;
    snprintf(c->name, sizeof(c->name), "%s", s->name);
    c->batch = pick_batch(in, split);
    c->mem_bytes = memory_at(in, split, c->batch);
    c->fits = !in->mem_budget || memory_at(in, split, 1) <= (double)in->mem_budget;

    size_t feat = (size_t)s->out_elems * (in->dtype == HAPI_DTYPE_FP16 ? 2 : 4);
    c->file_bytes = (uint64_t)(in->header_bytes + feat);
    c->within_bytes = !(in->link_bytes > 0) || !(in->source_bytes > 0) ||
                      (double)c->file_bytes <= in->link_bytes * in->source_bytes;

    /* Workers run batches side by side, each with the profile's threads. Decode overlaps
       inference only when there are cores for both. */
    int workers = in->inference_workers > 0 ? in->inference_workers : 1;
    double infer = hapi_profile_ms(p, 0, split, c->batch) / workers;
    double decode = in->decode_ms / (in->decode_threads > 0 ? in->decode_threads : 1);
    c->storage_ms = p->cores >= p->threads * workers + in->decode_threads
                        ? fmax(infer, decode) : infer + in->decode_ms;
    double received;
    c->reader_ms = reader_cost(in, (double)c->file_bytes, &received);
    struct link_cost l = link_terms(in, (double)c->file_bytes, (double)in->header_bytes,
                                    c->reader_ms, c->reader_ms - received);
    c->link_file_ms = l.file_ms;
    c->link_bytes_ms = l.bytes_ms;
    c->link_trips_ms = l.trips_ms;
    c->link_pack_ms = l.pack_ms;
    c->compute_ms = compute_stages_ms(in, split, in->freeze);

    /* What is cached costs a hit; what does not fit the cache is computed every epoch. */
    double cached = in->cached[split];
    cached = cached < 0 ? 0 : cached > 1 ? 1 : cached;
    double fit = 1.0;
    if (in->cache_room && in->samples) {
        double entry = in->cache_entry_bytes[split] > 0 ? in->cache_entry_bytes[split]
                                                         : (double)feat;
        double need = (double)in->samples * entry;
        fit = need > 0 ? fmin(1.0, (double)in->cache_room / need) : 1.0;
    }
    if (cached > fit)
        fit = cached;
    c->storage_fit = fit;
    /* A hit and the transport's own work are measured at a whole CPU: a CFS quota slows them. */
    double slow = storage_slowdown(p);
    double hit = in->hit_ms * slow, storage_file = in->storage_file_ms * slow;
    /* A feature computed on demand also costs its serving: storage_serve_ms. */
    double computed = c->storage_ms + in->storage_serve_ms * slow;
    double cold_storage = (1 - cached) * computed + cached * hit;
    double warm_storage = (1 - fit) * computed + fit * hit;
    /* Per file, a later epoch reads again what the compute tier did not keep; what it kept
       costs the storage tier an open, the link the requests. The transport's own CPU per file
       is paid on both tiers for every file of every epoch. */
    double kept = compute_kept(in, (double)c->file_bytes, samples);
    c->compute_kept = kept;
    double file_warm_link = kept * l.kept_ms + (1 - kept) * l.file_ms;
    double file_warm_storage = kept * hit + (1 - kept) * warm_storage;
    double compute = c->compute_ms + c->reader_ms, compute_warm = compute - kept * received;
    double file_cold = cold_file_ms(cold_storage + storage_file, l.file_ms, compute, 1 - cached);
    double file_warm = max3(file_warm_storage + storage_file, file_warm_link, compute_warm);
    /* With packs (a compute-side -o remote; its default features=freeze) a row crosses the link
       once, and the compute tier runs stages [split, freeze) on it once and keeps the freeze
       point's feature: the first epoch pays the stages and the row's bytes received, every
       epoch the reader's work on a freeze-point file that is a hit in the compute node's own
       cache (a hit there costs what one here does). A later epoch does not depend on the
       split. */
    double reader_freeze = pack_reader_ms(in);
    double pack_compute = c->compute_ms + received + reader_freeze;
    double pack_cold = max3(cold_storage, l.pack_ms, pack_compute);
    double pack_warm = fmax(in->hit_ms, reader_freeze);
    c->total_file_s = (file_cold + (in->epochs - 1) * file_warm) * samples / 1e3;
    c->total_pack_s = (pack_cold + (in->epochs - 1) * pack_warm) * samples / 1e3;
    int pack = in->transport == HAPI_TRANSPORT_PACK;
    c->link_ms = pack ? l.pack_ms : l.file_ms;
    c->link_warm_ms = pack ? 0 : file_warm_link;
    double cold = pack ? pack_cold : file_cold, warm = pack ? pack_warm : file_warm;
    c->cold_bound = pack ? bound_of(cold_storage, l.pack_ms, pack_compute)
                         : bound_of(cold_storage + storage_file, l.file_ms, compute);
    c->warm_bound = pack ? (in->hit_ms > reader_freeze ? "storage" : "compute")
                         : bound_of(file_warm_storage + storage_file, file_warm_link,
                                    compute_warm);
    c->cold_s = cold * samples / 1e3;
    c->warm_s = warm * samples / 1e3;
    c->total_s = c->cold_s + (in->epochs - 1) * c->warm_s;
}

static void estimate_raw(const hapi_policy_input *in, hapi_policy_candidate *c, double samples)
{
    const hapi_profile *p = in->profile;
    memset(c, 0, sizeof(*c));
    snprintf(c->name, sizeof(c->name), "raw");
    c->file_bytes = (uint64_t)in->source_bytes;
    c->fits = 1;
    c->within_bytes = 1;
    c->storage_ms = (in->hit_ms + in->storage_file_ms) * storage_slowdown(p); /* serving a file */
    /* raw images are read one file at a time whatever serves the features; the reader decodes
       them too */
    double trunk = compute_stages_ms(in, 0, in->freeze);
    double decode = in->decode_ms / in->client_speed, received;
    c->compute_ms = trunk + decode;
    c->reader_ms = reader_cost(in, in->source_bytes, &received) + decode;
    struct link_cost l = link_terms(in, in->source_bytes, 0, c->reader_ms,
                                    c->reader_ms - received);
    c->link_ms = c->link_file_ms = l.file_ms;
    c->link_bytes_ms = l.bytes_ms;
    c->link_trips_ms = l.trips_ms;
    c->link_pack_ms = l.pack_ms;
    c->compute_kept = compute_kept(in, in->source_bytes, samples);
    c->link_warm_ms = c->compute_kept * l.kept_ms + (1 - c->compute_kept) * l.file_ms;
    /* the decode is the reader's, the trunk the training loop's */
    double compute = trunk + c->reader_ms;
    double compute_warm = compute - c->compute_kept * received;
    double cold = max3(c->storage_ms, c->link_ms, compute);
    double warm = max3(c->storage_ms, c->link_warm_ms, compute_warm);
    c->cold_bound = bound_of(c->storage_ms, c->link_ms, compute);
    c->warm_bound = bound_of(c->storage_ms, c->link_warm_ms, compute_warm);
    c->cold_s = cold * samples / 1e3;
    c->warm_s = warm * samples / 1e3;
    c->total_s = c->total_file_s = c->total_pack_s = c->cold_s + (in->epochs - 1) * c->warm_s;
}

static int better(const hapi_policy_candidate *a, const hapi_policy_candidate *b)
{
    if (a->fits != b->fits)
        return a->fits;
    /* within link_bytes first; of two over it, the fewer bytes */
    if (a->within_bytes != b->within_bytes)
        return a->within_bytes;
    if (!a->within_bytes && a->file_bytes != b->file_bytes)
        return a->file_bytes < b->file_bytes;
    /* within half a percent, fewer bytes on the link wins */
    if (fabs(a->total_s - b->total_s) <= 0.005 * fmax(a->total_s, b->total_s))
        return a->file_bytes < b->file_bytes;
    return a->total_s < b->total_s;
}

static void fmt_time(double s, char *buf, size_t size)
{
    if (s >= 3600)
        snprintf(buf, size, "%.1f h", s / 3600);
    else if (s >= 60)
        snprintf(buf, size, "%.1f min", s / 60);
    else if (s >= 1)
        snprintf(buf, size, "%.2f s", s);
    else
        snprintf(buf, size, "%.1f ms", s * 1e3);
}

int hapi_policy_choose(const hapi_policy_input *in, hapi_policy_choice *out, hapi_error *err)
{
    memset(out, 0, sizeof(*out));
    const hapi_profile *p = in ? in->profile : NULL;
    if (!p || p->nstages < 1 || p->nstages > HAPI_PROFILE_MAX_STAGES || p->nbatches < 1)
        return hapi_error_set(err, HAPI_EINVAL, "policy: no profile");
    if (in->freeze < 1 || in->freeze > p->nstages)
        return hapi_error_set(err, HAPI_EINVAL, "policy: freeze %d out of range 1..%d",
                              in->freeze, p->nstages);
    if (!(in->link_bps > 0) || !(in->client_speed > 0) || in->epochs < 1 || in->batch < 0 ||
        in->batch > HAPI_BATCH_MAX || !(in->rtt_s >= 0) || in->readers < 0 ||
        !(in->compute_cache >= 0) || !(in->storage_file_ms >= 0) || !(in->compute_file_ms >= 0) ||
        !(in->storage_serve_ms >= 0) || !(in->compute_byte_ns >= 0) ||
        !(in->compute_load_ns >= 0) ||
        !(in->request_ms >= 0) || in->compute_nstages < 0 ||
        in->compute_nstages > HAPI_PROFILE_MAX_STAGES ||
        (in->transport != HAPI_TRANSPORT_FILE && in->transport != HAPI_TRANSPORT_PACK))
        return hapi_error_set(err, HAPI_EINVAL,
                              "policy: link rate, client speed, epochs and batch must be positive, "
                              "rtt, readers, compute cache and per-file costs not negative, "
                              "transport file or pack");
    for (int i = 0; i < in->compute_nstages; i++)
        if (!(in->compute_stage_ms[i] >= 0) || !isfinite(in->compute_stage_ms[i]))
            return hapi_error_set(err, HAPI_EINVAL, "policy: compute stage %d's time %g is not "
                                  "a time", i, in->compute_stage_ms[i]);
    if (in->split < 0 || in->split > in->freeze)
        return hapi_error_set(err, HAPI_EINVAL,
                              "policy: split %d is past the freeze index %d (stages [0, %d) are "
                              "frozen)", in->split, in->freeze, in->freeze);

    double samples = in->samples ? (double)in->samples : 1000.0;
    out->samples = samples;
    out->ncand = in->freeze;
    int best = 0;
    for (int s = 1; s <= in->freeze; s++) {
        estimate(in, s, &out->cand[s - 1], samples);
        if (s > 1 && better(&out->cand[s - 1], &out->cand[best]))
            best = s - 1;
    }
    estimate_raw(in, &out->raw, samples);
    int chosen = in->split ? in->split - 1 : best;
    out->index = chosen;
    out->split = out->cand[chosen].split;
    out->batch = out->cand[chosen].batch;

    /* Why: the winner against the runner-up and the usual pipeline. */
    const hapi_policy_candidate *w = &out->cand[best], *c = &out->cand[chosen];
    int second = -1;
    for (int i = 0; i < out->ncand; i++)
        if (i != best && out->cand[i].within_bytes == w->within_bytes &&
            (second < 0 || better(&out->cand[i], &out->cand[second])))
            second = i;
    char t1[32], t2[32], t3[32];
    fmt_time(w->total_s, t1, sizeof(t1));
    fmt_time(c->total_s, t3, sizeof(t3));
    int n = 0;
    size_t sz = sizeof(out->why);
    if (in->split)
        n += snprintf(out->why + n, sz - (size_t)n,
                      "split %d (%s) was set by the operator (estimated %s over %d epochs); "
                      "the policy would pick %s (split %d): ",
                      c->split, c->name, t3, in->epochs, w->name, w->split);
    if (!w->within_bytes) {
        n += snprintf(out->why + n, sz - (size_t)n, "%s puts the fewest bytes on the link: %s "
                      "over %d epochs. ", w->name, t1, in->epochs);
    } else if (second >= 0) {
        const hapi_policy_candidate *r = &out->cand[second];
        fmt_time(r->total_s, t2, sizeof(t2));
        n += snprintf(out->why + n, sz - (size_t)n,
                      "%s has the least estimated time over %d epochs, %s, against %s for %s "
                      "(+%.0f%%). ",
                      w->name, in->epochs, t1, t2, r->name,
                      w->total_s > 0 ? fmax(0, r->total_s / w->total_s - 1) * 100 : 0.0);
    } else if (out->ncand > 1) {
        n += snprintf(out->why + n, sz - (size_t)n, "%s is the only split within link_bytes=%g: "
                      "%s over %d epochs. ", w->name, in->link_bytes, t1, in->epochs);
    } else {
        n += snprintf(out->why + n, sz - (size_t)n, "%s is the only frozen split: %s over %d "
                      "epochs. ", w->name, t1, in->epochs);
    }
    if (n < (int)sz)
        n += snprintf(out->why + n, sz - (size_t)n,
                      "Its first epoch is bound by the %s tier, later ones by the %s tier. ",
                      w->cold_bound, w->warm_bound);
    /* what link_bytes cost: the fastest split that fits, when the bound kept it out */
    int fastest = -1;
    for (int i = 0; i < out->ncand; i++)
        if (out->cand[i].fits == w->fits &&
            (fastest < 0 || out->cand[i].total_s < out->cand[fastest].total_s))
            fastest = i;
    if (n < (int)sz && !w->within_bytes)
        n += snprintf(out->why + n, sz - (size_t)n,
                      "No split's .feat is within link_bytes=%g of a source image (%.0f bytes): "
                      "the fewest bytes won. ", in->link_bytes, in->source_bytes);
    else if (n < (int)sz && fastest >= 0 && fastest != best &&
             out->cand[fastest].total_s < w->total_s && !out->cand[fastest].within_bytes) {
        const hapi_policy_candidate *f = &out->cand[fastest];
        fmt_time(f->total_s, t2, sizeof(t2));
        n += snprintf(out->why + n, sz - (size_t)n,
                      "%s would take %s (-%.0f%%) but put %.1fx a source image's bytes on the "
                      "link, over link_bytes=%g. ",
                      f->name, t2, (1 - f->total_s / w->total_s) * 100,
                      (double)f->file_bytes / in->source_bytes, in->link_bytes);
    }
    if (n < (int)sz && out->raw.total_s > 0 && w->total_s > 0)
        n += snprintf(out->why + n, sz - (size_t)n,
                      "Raw images would take %.1fx as long and move %.1fx the bytes.",
                      out->raw.total_s / w->total_s,
                      (out->raw.file_bytes + HAPI_POLICY_FILE_OVERHEAD) /
                          (double)(w->file_bytes + HAPI_POLICY_FILE_OVERHEAD));
    if (!w->fits && n < (int)sz)
        snprintf(out->why + n, sz - (size_t)n,
                 " No split fits mem=%llu at batch 1: raise mem.",
                 (unsigned long long)in->mem_budget);
    return 0;
}

/* --------------------------------------------------------------- JSON */

static json_t *candidate_json(const hapi_policy_candidate *c, double cached, int chosen)
{
    json_t *j = json_pack("{s:i, s:s, s:i, s:I, s:I, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, "
                     "s:f, s:s, s:s, s:f, s:b, s:b, s:b}",
                     "split", c->split, "stage", c->name, "batch", c->batch, "memory",
                     (json_int_t)c->mem_bytes, "file_bytes", (json_int_t)c->file_bytes,
                     "storage_ms", c->storage_ms, "link_ms", c->link_ms, "link_file_ms",
                     c->link_file_ms, "link_pack_ms", c->link_pack_ms, "compute_ms",
                     c->compute_ms, "cold_epoch_s", c->cold_s, "warm_epoch_s", c->warm_s,
                     "total_s", c->total_s, "total_file_s", c->total_file_s, "total_pack_s",
                     c->total_pack_s, "cold_bound", c->cold_bound, "warm_bound",
                     c->warm_bound, "cached", cached, "fits", c->fits, "chosen", chosen,
                     "within_link_bytes", c->within_bytes);
    /* the link's terms and the caches of both tiers, as hapifs-ctl policy explains them */
    json_t *terms = json_pack("{s:f, s:f, s:f, s:f, s:f, s:f}", "link_bytes_ms", c->link_bytes_ms,
                              "link_trips_ms", c->link_trips_ms, "reader_ms", c->reader_ms,
                              "link_warm_ms", c->link_warm_ms, "compute_kept", c->compute_kept,
                              "storage_fit", c->storage_fit);
    if (!j || !terms || json_object_update(j, terms) < 0) {
        json_decref(j);
        j = NULL;
    }
    json_decref(terms);
    return j;
}

char *hapi_policy_to_json(const hapi_policy_input *in, const hapi_policy_choice *c)
{
    char rate[32];
    hapi_policy_format_rate(in->link_bps, rate, sizeof(rate));
    json_t *cands = json_array();
    for (int i = 0; i < c->ncand; i++)
        json_array_append_new(cands, candidate_json(&c->cand[i], in->cached[c->cand[i].split],
                                                    i == c->index));
    json_t *root = json_pack(
        "{s:{s:s, s:f, s:f, s:i, s:s, s:f, s:I, s:i, s:i, s:s, s:f, s:f, s:f, s:I, s:I, s:s, "
        "s:s}, "
        "s:{s:i, s:s, s:i, s:s}, s:s, s:f, s:o, s:o}",
        "inputs",
          "link", rate, "link_bps", in->link_bps, "rtt_ms", in->rtt_s * 1e3, "readers",
          in->readers > 0 ? in->readers : HAPI_POLICY_READERS_DEFAULT, "transport",
          in->transport == HAPI_TRANSPORT_PACK ? "pack" : "file", "client_speed",
          in->client_speed,
          "mem_budget", (json_int_t)in->mem_budget, "freeze", in->freeze, "epochs", in->epochs,
          "dtype", in->dtype == HAPI_DTYPE_FP16 ? "float16" : "float32",
          "decode_ms", in->decode_ms, "source_bytes", in->source_bytes, "hit_ms", in->hit_ms,
          "samples", (json_int_t)in->samples, "cache_room", (json_int_t)in->cache_room,
          "batch", in->batch ? "fixed" : "auto", "split", in->split ? "fixed" : "auto",
        "choice",
          "split", c->split, "stage", c->cand[c->index].name, "batch", c->batch,
          "by", in->split ? "operator" : "policy",
        "why", c->why,
        "epoch_samples", c->samples,
        "candidates", cands,
        "raw", candidate_json(&c->raw, 0, 0));
    if (!root)
        return NULL;
    json_t *more = json_pack("{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:i, s:i, s:f}",
                             "compute_cache", in->compute_cache, "link_bytes", in->link_bytes,
                             "storage_file_ms", in->storage_file_ms, "storage_serve_ms",
                             in->storage_serve_ms, "compute_byte_ns", in->compute_byte_ns,
                             "compute_load_ns", in->compute_load_ns, "compute_file_ms",
                             in->compute_file_ms, "request_ms", in->request_ms,
                             "file_overhead_bytes", HAPI_POLICY_FILE_OVERHEAD,
                             "file_round_trips", HAPI_POLICY_FILE_ROUND_TRIPS, "cold_norm",
                             HAPI_POLICY_COLD_NORM);
    json_t *stages = json_array(), *entries = json_array();
    for (int i = 0; i < in->compute_nstages; i++)
        json_array_append_new(stages, json_real(in->compute_stage_ms[i]));
    for (int s = 1; s <= in->freeze && s <= HAPI_PROFILE_MAX_STAGES; s++)
        json_array_append_new(entries, json_real(in->cache_entry_bytes[s]));
    /* the rest of the inputs, so that hapi_policy_input_from_json() gives them all back */
    json_t *rest = json_pack("{s:i, s:i, s:I, s:I}", "decode_threads", in->decode_threads,
                             "inference_workers", in->inference_workers > 0
                                                      ? in->inference_workers : 1,
                             "header_bytes", (json_int_t)in->header_bytes, "input_bytes",
                             (json_int_t)in->input_bytes);
    if (more && rest && json_object_update(more, rest) == 0) {
        json_object_set_new(more, "compute_stages_ms", stages);
        json_object_set_new(more, "cache_entry_bytes", entries);
    } else {
        json_decref(stages);
        json_decref(entries);
        json_decref(more);
        more = NULL;
    }
    json_decref(rest);
    if (!more || json_object_update(json_object_get(root, "inputs"), more) < 0) {
        json_decref(more);
        json_decref(root);
        return NULL;
    }
    json_decref(more);
    char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    return text;
}

/* A number of obj (0 when absent); *bad set when it is there and not a number. */
static double num_of(json_t *obj, const char *key, int *bad)
{
    json_t *v = json_object_get(obj, key);
    if (v && !json_is_number(v))
        *bad = 1;
    return v ? json_number_value(v) : 0;
}

int hapi_policy_input_from_json(const char *text, const hapi_profile *profile,
                                hapi_policy_input *out, hapi_error *err)
{
    json_error_t je;
    json_t *root = json_loads(text, 0, &je);
    if (!root)
        return hapi_error_set(err, HAPI_EINVAL, "not JSON: %s (line %d)", je.text, je.line);
    json_t *in = json_object_get(root, "inputs") ? json_object_get(root, "inputs") : root;
    json_t *choice = json_object_get(root, "choice");
    json_t *cands = json_object_get(root, "candidates");
    int rc = 0, bad = 0;

    memset(out, 0, sizeof(*out));
    out->profile = profile;
    static const char *const need[] = { "link_bps", "client_speed", "freeze", "epochs", "dtype",
                                        "decode_ms", "hit_ms" };
    for (size_t k = 0; k < sizeof(need) / sizeof(need[0]); k++)
        if (!json_object_get(in, need[k])) {
            rc = hapi_error_set(err, HAPI_EINVAL, "policy inputs: no \"%s\"", need[k]);
            goto out;
        }
    out->link_bps = num_of(in, "link_bps", &bad);
    out->rtt_s = num_of(in, "rtt_ms", &bad) / 1e3;
    out->readers = (int)num_of(in, "readers", &bad);
    out->client_speed = num_of(in, "client_speed", &bad);
    out->mem_budget = (uint64_t)num_of(in, "mem_budget", &bad);
    out->freeze = (int)num_of(in, "freeze", &bad);
    out->epochs = (int)num_of(in, "epochs", &bad);
    out->decode_ms = num_of(in, "decode_ms", &bad);
    out->source_bytes = num_of(in, "source_bytes", &bad);
    out->hit_ms = num_of(in, "hit_ms", &bad);
    out->samples = (uint64_t)num_of(in, "samples", &bad);
    out->cache_room = (uint64_t)num_of(in, "cache_room", &bad);
    out->compute_cache = num_of(in, "compute_cache", &bad);
    out->link_bytes = num_of(in, "link_bytes", &bad); /* absent: no bound, as chosen then */
    out->storage_file_ms = num_of(in, "storage_file_ms", &bad);
    out->storage_serve_ms = num_of(in, "storage_serve_ms", &bad);
    out->compute_byte_ns = num_of(in, "compute_byte_ns", &bad);
    out->compute_load_ns = num_of(in, "compute_load_ns", &bad);
    out->compute_file_ms = num_of(in, "compute_file_ms", &bad);
    out->request_ms = num_of(in, "request_ms", &bad);
    out->decode_threads = json_object_get(in, "decode_threads")
                              ? (int)num_of(in, "decode_threads", &bad) : 1;
    out->inference_workers = json_object_get(in, "inference_workers")
                                 ? (int)num_of(in, "inference_workers", &bad) : 1;
    out->header_bytes = (size_t)num_of(in, "header_bytes", &bad);
    out->input_bytes = (size_t)num_of(in, "input_bytes", &bad);
    const char *dtype = json_string_value(json_object_get(in, "dtype"));
    const char *transport = json_string_value(json_object_get(in, "transport"));
    if (bad || !dtype || (strcmp(dtype, "float16") && strcmp(dtype, "float32")) ||
        (transport && strcmp(transport, "file") && strcmp(transport, "pack"))) {
        rc = hapi_error_set(err, HAPI_EINVAL, "policy inputs: a number is not a number, or "
                            "dtype is not float16/float32, or transport not file/pack");
        goto out;
    }
    out->dtype = !strcmp(dtype, "float16") ? HAPI_DTYPE_FP16 : HAPI_DTYPE_FP32;
    out->transport = transport && !strcmp(transport, "pack") ? HAPI_TRANSPORT_PACK
                                                            : HAPI_TRANSPORT_FILE;
    if (!profile || out->freeze < 1 || out->freeze > profile->nstages) {
        rc = hapi_error_set(err, HAPI_EINVAL, "policy inputs: freeze %d and the profile's %d "
                            "stages disagree", out->freeze, profile ? profile->nstages : 0);
        goto out;
    }
    json_t *stages = json_object_get(in, "compute_stages_ms");
    if (json_array_size(stages) > HAPI_PROFILE_MAX_STAGES) {
        rc = hapi_error_set(err, HAPI_EINVAL, "policy inputs: too many compute_stages_ms");
        goto out;
    }
    out->compute_nstages = (int)json_array_size(stages);
    for (int i = 0; i < out->compute_nstages; i++)
        out->compute_stage_ms[i] = json_number_value(json_array_get(stages, (size_t)i));
    json_t *entries = json_object_get(in, "cache_entry_bytes");
    for (int s = 1; s <= out->freeze && s <= (int)json_array_size(entries); s++)
        out->cache_entry_bytes[s] = json_number_value(json_array_get(entries, (size_t)s - 1));
    if (!json_object_get(in, "header_bytes")) { /* written before it was: the daemon's way */
        const hapi_profile_stage *last = &profile->stage[profile->nstages - 1];
        char header[HAPI_NPY_HEADER_MAX];
        int len = hapi_npy_header(header, out->dtype, last->shape, last->ndim);
        out->header_bytes = len > 0 ? (size_t)len : 0;
    }
    /* what an operator fixed, and what was cached then */
    const char *bfix = json_string_value(json_object_get(in, "batch"));
    const char *sfix = json_string_value(json_object_get(in, "split"));
    if (bfix && !strcmp(bfix, "fixed"))
        out->batch = (int)json_integer_value(json_object_get(choice, "batch"));
    if (sfix && !strcmp(sfix, "fixed"))
        out->split = (int)json_integer_value(json_object_get(choice, "split"));
    size_t i;
    json_t *c;
    json_array_foreach(cands, i, c) {
        int s = (int)json_integer_value(json_object_get(c, "split"));
        if (s >= 1 && s <= HAPI_PROFILE_MAX_STAGES)
            out->cached[s] = json_number_value(json_object_get(c, "cached"));
    }
out:
    json_decref(root);
    return rc;
}
