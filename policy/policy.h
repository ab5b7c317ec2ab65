/* policy.h — where to split the network and how big a storage-side batch: a measured profile and a pure choice. */
#ifndef HAPI_POLICY_H
#define HAPI_POLICY_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "extractor.h"
#include "hapi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ----------------------------------------------------------------- profile */

#define HAPI_PROFILE_MAX_STAGES 64
#define HAPI_PROFILE_MAX_BATCHES 4
#define HAPI_PROFILE_VERSION 2 /* 2: the least of several sweeps (1: one, disturbed) */
#define HAPI_PROFILE_BUDGET_S 20.0  /* batches past 1 only while the profile fits this */
#define HAPI_PROFILE_MAX_SWEEPS 6  /* the least of at most this many sweeps */

/* What one stage costs on this node, measured. */
typedef struct hapi_profile_stage {
    char name[HAPI_STAGE_NAME_MAX];
    int ndim;
    int64_t shape[HAPI_MAX_DIMS];   /* output of one sample */
    uint64_t out_elems;             /* elements of that output */
    uint64_t param_bytes;           /* weights and buffers */
    double ms[HAPI_PROFILE_MAX_BATCHES]; /* wall ms per sample at hapi_profile.batches[i] */
    /* working memory while the stage runs (its output and temporaries, not its
       input): about mem_fixed + mem_per_sample * batch bytes */
    double mem_fixed;
    double mem_per_sample;
} hapi_profile_stage;

/* A model's profile on one node: a function of (model digest, device, threads). */
typedef struct hapi_profile {
    int version;
    char model_digest[33];          /* hex */
    char device[64];
    int threads;                    /* libtorch intra-op threads it ran with */
    int cores;                      /* CPUs the daemon may run on (its affinity) */
    double cpu_quota;               /* CPUs its cgroup's CFS quota allows (0: no quota) */
    int nbatches;
    int batches[HAPI_PROFILE_MAX_BATCHES]; /* ascending */
    int nstages;
    hapi_profile_stage stage[HAPI_PROFILE_MAX_STAGES];
    uint64_t runtime_bytes;         /* resident memory with the model loaded (libraries, weights) */
    int mem_measured;               /* 1: peaks measured with the kernel's high-water mark;
                                       0: estimated from tensor sizes (no /proc) */
    double seconds;                 /* how long measuring took */
    int sweeps;                     /* sweeps over the batches it took to settle */
    int64_t measured_at;            /* unix time */
} hapi_profile;

/*
 * Measures m (probed; nothing else may run inference meanwhile, or the figures
 * are disturbed): every stage at batches 1, 4 and 16 (a batch only when twice
 * its widest activation stays under max_batch_bytes, 0 = no cap, and while the
 * profile's estimated time stays within HAPI_PROFILE_BUDGET_S), the mean of at
 * least three timed runs and 100 ms (at most 40 runs) after warm-up runs, so
 * that a CPU quota's stalls are counted; the least such mean of two to six
 * sweeps over the batches, until a sweep lowers no batch's sum by more than 5%
 * (a mount's start-up disturbs the first ones: hapi_profile_sweep_again()).
 * Under a CFS quota of fewer CPUs than threads (hapi_cpu_quota()), each
 * stage's CPU time divided by the quota instead of its wall time (the stalls
 * fall on whichever stage runs). And each stage's peak memory at the smallest
 * and largest batch. digest is the model file's XXH3-128, device and threads
 * what it runs with. stop (may be NULL) set nonzero ends it between runs with
 * -ECANCELED (an unmount need not wait for a big model's profile).
 * Returns 0, -ECANCELED, or an error of hapi_model_measure().
 */
int hapi_profile_measure(hapi_model *m, const uint8_t digest[16], const char *device,
                         int threads, uint64_t max_batch_bytes, atomic_int *stop,
                         hapi_profile *out, hapi_error *err);

/*
 * The CPU quota of the process whose cgroups proc_cgroup lists ("/proc/self/cgroup"), under
 * the cgroup file systems at root ("/sys/fs/cgroup"): the least over its cpu group and their
 * parents of cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us or v2's cpu.max, in CPUs (0.25
 * for a quarter of one); 0 when none is set or nothing could be read.
 */
double hapi_cpu_quota(const char *proc_cgroup, const char *root);

/* The profile as JSON text (malloc'd, caller frees), or NULL when out of memory. */
char *hapi_profile_to_json(const hapi_profile *p);

/* Parses JSON text written by hapi_profile_to_json(). Returns 0 or HAPI_EINVAL (says what). */
int hapi_profile_from_json(const char *text, hapi_profile *out, hapi_error *err);

/*
 * The file name a profile of (digest, device, threads) is stored under in a
 * cache directory: "profile-<digest>-<device>-t<threads>.json" into buf.
 */
void hapi_profile_file_name(const uint8_t digest[16], const char *device, int threads,
                            char *buf, size_t size);

/* Reads a stored profile. Returns 0, -ENOENT (none), -errno, or HAPI_EINVAL (unreadable: says why). */
int hapi_profile_load(const char *path, hapi_profile *out, hapi_error *err);

/*
 * Whether hapi_profile_measure() sweeps the batches again after `sweeps` sweeps (the last of
 * which took sweep_s, the profile elapsed_s so far): never after HAPI_PROFILE_MAX_SWEEPS, nor
 * once a sweep lowered no batch's sum by more than 5% (`lowered` 0); always after the first,
 * since a figure from one sweep is the start-up's (measured: a VGG-16 block 6x slow after a
 * throttled start, with no second sweep to take the least of); from the second on only while
 * another sweep fits HAPI_PROFILE_BUDGET_S.
 */
int hapi_profile_sweep_again(int sweeps, int lowered, double elapsed_s, double sweep_s);

/* Stores a profile atomically (a temporary file renamed). Returns 0 or -errno. */
int hapi_profile_save(const char *path, const hapi_profile *p, hapi_error *err);

/* Stores text and a newline at path atomically (a temporary file, synced, renamed). Returns 0
   or -errno. */
int hapi_policy_save_text(const char *path, const char *text, hapi_error *err);

/*
 * Milliseconds per sample of stages [from, to) at batch (interpolated between
 * the measured batches; the largest measured beyond them).
 */
double hapi_profile_ms(const hapi_profile *p, int from, int to, int batch);

/*
 * Peak working memory in bytes of running stages [0, split) at batch: the
 * weights of those stages plus the largest stage's working memory.
 */
double hapi_profile_memory(const hapi_profile *p, int split, int batch);

/* ------------------------------------------------------------------ choice */

#define HAPI_POLICY_EPOCHS_DEFAULT 5
#define HAPI_POLICY_LINK_DEFAULT 1e9         /* bits/s when link= is not given */
/* link_bytes= when not given: a split never puts more on the link than the images would.
   The link is what this system exists to relieve, and it is shared: the policy costs one
   job's time, not what its bytes cost the link's other users. Without a bound, a storage node
   4x slower than the compute tier picks ResNet-50's stem (401 KB a sample in fp16 against a
   ~100 KB JPEG): 4.35x faster than the usual pipeline over 5 epochs at 100 Mbit, but 3.75x
   its bytes (bench/bench-e2e, docs/deployment.md). */
#define HAPI_POLICY_LINK_BYTES_DEFAULT 1.0
#define HAPI_POLICY_BATCH_CAP 32             /* batch=auto never goes beyond: larger batches
                                                gained nothing per sample on CPUs measured */
#define HAPI_POLICY_FILE_OVERHEAD 512        /* bytes on the link per file beyond its content:
                                                protocol messages to open, read and close it */
#define HAPI_POLICY_FILE_ROUND_TRIPS 4       /* per file read through a network filesystem:
                                                lookup, open, read, release (sshfs, NFS) */
#define HAPI_POLICY_READERS_DEFAULT 8        /* concurrent per-file readers on the compute tier */
#define HAPI_POLICY_PACK_INDEX_BYTES 130     /* a pack index's bytes per image (name, identity) */
#define HAPI_POLICY_KEPT_ROUND_TRIPS 1       /* per file the compute tier still holds in its page
                                                cache: sshfs sends OPEN and CLOSE at every open()
                                                but waits only for the OPEN (its CLOSE, sent on
                                                FUSE's release, expects no reply). Measured:
                                                VGG-16's fc7 later epochs, 1,000 kept files, 2
                                                readers: 0.35 ms a file more at RTT 1 ms than at
                                                0; 2 round trips charged 1.0 ms, 1 charges 0.5 */
#define HAPI_POLICY_KEPT_OVERHEAD 700        /* ... and their bytes (measured: ~0.7 KB per open) */
/* The transport's own costs through sshfs, measured with bench/hapifs-cluster's tiers on a core
   each (800 cached 1.1 KB .feat files, 2-32 readers, AMD EPYC, a busy machine): CPU per file on
   the storage tier (sftp server, sshd) 0.25-0.43 ms; the time a request takes beyond the RTT,
   0.64 ms (2 readers). The compute tier's per sample is what a training loop costs beside the
   trunk: sshfs and ssh, the DataLoader's workers (np.load, collation), the head's step. Fitted
   from bench/bench-policy --grid's later epochs at the freeze split, where nothing else runs
   there (examples/train.py, 2 workers, batch 32, ResNet-18 at 64 px, 1,000 files): 1.3-1.8 ms
   per sample (a microbenchmark of the reads alone gave 0.30-0.48 ms). */
#define HAPI_POLICY_STORAGE_FILE_MS 0.3
#define HAPI_POLICY_COMPUTE_FILE_MS 1.5
/* What a first epoch costs beyond that, fitted from the grid's first epochs (ResNet-18 at 64 px,
   1,000 files, tiers 1x, 100 Mbit and unshaped): the storage tier's first epoch at the later
   splits took 1.0-2.0 ms per sample more than decode, the stages and the per-file CPU; the
   compute tier's at the early splits (33 KB files) 1.2-1.6 ms more than its later epochs, with
   the link unshaped as at 100 Mbit (CPU, not the link): ~36 ns per byte received. */
#define HAPI_POLICY_STORAGE_SERVE_MS 1.5
#define HAPI_POLICY_COMPUTE_BYTE_NS 36.0
/* And what loading a file costs every epoch, received or kept: fitted from the grid's later
   epochs at the early splits with the compute tier keeping every file (ResNet-18 at 64 px, 32
   KB files; 100 Mbit at RTT 0 and 1 Gbit at 1 ms, 1x and 4x): 0.5-1.1 ms per file beyond the
   trunk and the loop, median 0.67 ms: ~20 ns per byte. */
#define HAPI_POLICY_COMPUTE_LOAD_NS 20.0
#define HAPI_POLICY_REQUEST_MS 0.6
/* A first epoch read one file at a time is slower than its slowest tier: the readers ask for
   files in a shuffled order while the storage tier computes them a folder at a time, so the
   tiers wait on each other, and more so the closer their times are. The per-file times of its
   tiers are combined by this norm, (s^p + l^p + c^p)^(1/p), instead of their maximum. Fitted on
   bench/bench-policy --grid's first epochs with train.py --trunk-first (ResNet-18 at 64 px,
   1,000 files, 1x, 1 Gbit, 100 Mbit and unshaped, RTT 0 and 1 ms, 30 runs): measured/max 1.01-
   1.61, median 1.25; the 3-norm brings 25 of 30 within 15% (the maximum 9), 2 and 4 fewer.
   Later epochs stay at the maximum, which fitted them best (22 of 30; the 3-norm 15). Over the
   96 runs of 16 cells since (ResNet-18 and -50, 1x, 4x, 10x): the 3-norm 73 within 15%, the
   maximum 45, the 4-norm 67, the maximum plus 0.3 of the second-slowest tier 80. */
#define HAPI_POLICY_COLD_NORM 3.0

/*
 * How the compute tier reads the features (hapi_policy_input.transport). Each
 * transport is costed by the same terms (policy.c, transport_terms): bytes per
 * file on the link, round trips per file (spread over the readers), and what
 * a later epoch finds in the compute tier's cache. A bulk path (many files per
 * request) would be one more row there: fewer round trips per file.
 */
enum hapi_policy_transport {
    HAPI_TRANSPORT_FILE = 0, /* one .feat at a time through a network filesystem: bytes plus
                                round trips per file, every epoch (the compute node keeps
                                nothing beyond its page cache) */
    HAPI_TRANSPORT_PACK = 1  /* a compute-side hapifs -o remote: a directory's features as one
                                pack, once; the compute tier runs [split, freeze) once per
                                sample (features=freeze, its default) and later epochs are hits
                                of the freeze point's features in its cache */
};

/* Everything the choice depends on. The function reads nothing else. */
typedef struct hapi_policy_input {
    const hapi_profile *profile;
    double link_bps;          /* link rate, bits per second (> 0) */
    double rtt_s;             /* the link's round-trip time, seconds (0: bytes alone) */
    int readers;              /* concurrent per-file readers (0: HAPI_POLICY_READERS_DEFAULT) */
    int transport;            /* enum hapi_policy_transport: what the epochs are estimated with */
    double client_speed;      /* compute tier's speed relative to this node (> 0); measured
                                 on the compute tier (examples/probe-speed.py) */
    int compute_nstages;      /* stages [0, compute_nstages) have compute_stage_ms (0: none) */
    double compute_stage_ms[HAPI_PROFILE_MAX_STAGES]; /* ms per sample of each frozen stage on
                                 the compute tier at its training batch, measured there
                                 (probe-speed.py); a stage without one costs its profile's
                                 time at the largest batch over client_speed */
    double compute_cache;     /* bytes of .feat files the compute tier keeps between epochs
                                 (its page cache; 0: none, every epoch reads across the link) */
    double storage_file_ms;   /* CPU per file the transport costs the storage tier (sftp
                                 server, ssh cipher), on top of serving it (0: none) */
    double compute_file_ms;   /* what the training loop costs the compute tier per sample beside
                                 the stages it runs (sshfs, the loader, the head's step);
                                 measured there (probe-speed.py), else
                                 HAPI_POLICY_COMPUTE_FILE_MS */
    double storage_serve_ms;  /* storage CPU per feature computed on demand beyond its decode and
                                 stages (queueing, the cache's write, the first reply) (0: none) */
    double compute_byte_ns;   /* compute CPU per byte of a file that crosses the link (the
                                 network stack, ssh's cipher, sshfs's copies) (0: none) */
    double compute_load_ns;   /* compute CPU per byte of a file the training loop loads, in
                                 every epoch (numpy.load, fp16 to fp32, collation) (0: none) */
    double request_ms;        /* what a request of the transport takes beyond the RTT (0: none) */
    uint64_t mem_budget;      /* storage-side bytes: weights, inference, images in flight */
    int freeze;               /* stages [0, freeze) are frozen: candidates 1..freeze */
    int epochs;               /* expected epochs (>= 1) */
    int dtype;                /* enum hapi_dtype */
    int decode_threads;
    int inference_workers;    /* inference threads, each running the profile's threads (0: 1) */
    size_t header_bytes;      /* .npy header of a .feat */
    size_t input_bytes;       /* one preprocessed sample, fp32 */
    double decode_ms;         /* decode + preprocess per sample on this node (measured) */
    double source_bytes;      /* mean size of a source image (for the raw reference) */
    double link_bytes;        /* the most bytes a split's .feat may put on the link per sample,
                                 as a multiple of source_bytes: a split over it wins only when
                                 no split is within it, and then the one with the fewest bytes
                                 (HAPI_POLICY_LINK_BYTES_DEFAULT, 1: never more than the images
                                 themselves); 0: no bound, as while source_bytes is unknown */
    double hit_ms;            /* serving one cached .feat on this node */
    uint64_t samples;         /* images in the tree (0: unknown; times per 1000 samples) */
    double cached[HAPI_PROFILE_MAX_STAGES + 1]; /* [split]: fraction already in the cache */
    uint64_t cache_room;      /* bytes the cache can hold (0: unlimited) */
    double cache_entry_bytes[HAPI_PROFILE_MAX_STAGES + 1]; /* [split]: bytes one cached
                                 feature takes in the store (0: its features alone) */
    int batch;                /* 0: choose (batch=auto), else this batch */
    int split;                /* 0: choose, else this split (the table still explains all) */
} hapi_policy_input;

/* One candidate split, estimated. Times are per sample in ms, epochs in seconds. */
typedef struct hapi_policy_candidate {
    int split;                /* stages [0, split) on storage; 0 for the raw reference */
    char name[HAPI_STAGE_NAME_MAX]; /* the last stage on storage ("raw" for the reference) */
    int batch;                /* storage-side batch at this split */
    double mem_bytes;         /* estimated storage-side memory at that batch */
    uint64_t file_bytes;      /* one .feat (header + features) */
    double storage_ms;        /* decode + inference of [0, split) on this node */
    double link_ms;           /* moving one sample by the input's transport */
    double link_file_ms;      /* ... one .feat per request: max(bytes, round trips / readers) */
    double link_bytes_ms;     /* its bytes term: (file + protocol overhead) over the rate */
    double link_trips_ms;     /* its readers' term: (round trips x (rtt + request_ms) +
                                 reader_ms) / readers */
    double reader_ms;         /* a reader's own work per file on the compute tier, after its
                                 wait: compute_file_ms, the file's bytes at compute_byte_ns
                                 (and the decode, for raw) */
    double link_warm_ms;      /* per sample in a later epoch, by the input's transport */
    double compute_kept;      /* fraction of the .feat files the compute tier keeps between
                                 epochs (compute_cache over the epoch's bytes, at most 1) */
    double storage_fit;       /* fraction of the features the storage cache holds by a later
                                 epoch (cache_room over their entries, or what is cached) */
    double link_pack_ms;      /* ... in a pack: its row and its index entry */
    double total_file_s;      /* total_s if the compute tier read per file */
    double total_pack_s;      /* total_s if it read packs (-o remote) */
    double compute_ms;        /* frozen stages [split, freeze) on the compute tier */
    double cold_s;            /* an epoch with this cache state */
    double warm_s;            /* an epoch once the features are cached */
    double total_s;           /* cold + (epochs - 1) * warm */
    const char *cold_bound;   /* "storage", "link" or "compute": what limits the cold epoch */
    const char *warm_bound;
    int fits;                 /* batch 1 fits the memory budget */
    int within_bytes;         /* file_bytes is within link_bytes x source_bytes (or no bound) */
} hapi_policy_candidate;

typedef struct hapi_policy_choice {
    int split;                /* the winner */
    int batch;
    int index;                /* of the winner in cand */
    int ncand;
    hapi_policy_candidate cand[HAPI_PROFILE_MAX_STAGES];
    hapi_policy_candidate raw; /* the usual pipeline: images over the link, all on the compute tier */
    double samples;           /* what the epoch times count (samples, or 1000 when unknown) */
    char why[768];            /* one paragraph: why the winner won */
} hapi_policy_choice;

/*
 * The choice. Every candidate split 1..freeze is estimated as a pipeline of
 * three tiers running side by side (storage: decode and stages [0, split);
 * link: the .feat; compute: stages [split, freeze) at compute_stage_ms, or
 * client_speed where those were not measured: every epoch per file, once with
 * packs); an epoch
 * takes as long as its slowest tier. A cached sample costs the storage tier
 * only a hit. The winner has the least time over epochs (ties: fewer bytes) of the
 * splits whose .feat is within link_bytes of a source image; when none is, the one
 * with the fewest bytes.
 * batch=auto is the batch (a power of two <= HAPI_POLICY_BATCH_CAP whose
 * memory estimate fits mem_budget) with the least time per sample; of those
 * within 3% of it, the smallest. Returns 0 or HAPI_EINVAL (bad input: says what).
 */
int hapi_policy_choose(const hapi_policy_input *in, hapi_policy_choice *out, hapi_error *err);

/* The inputs and the candidates table as JSON text (malloc'd), or NULL. */
char *hapi_policy_to_json(const hapi_policy_input *in, const hapi_policy_choice *c);

/*
 * The inputs back from hapi_policy_to_json()'s text (or from its "inputs" object alone) with
 * profile (borrowed: out->profile points to it): what an operator fixed from "choice", what was
 * cached from "candidates". Inputs written before header_bytes, input_bytes, decode_threads,
 * inference_workers and cache_entry_bytes were get the daemon's header for the profile's
 * output, 0, 1, 1 and 0. With the same code, hapi_policy_choose() then gives the same choice:
 * a choice can be replayed after the model changes (bench/policy-eval). Returns 0 or HAPI_EINVAL (says what).
 */
int hapi_policy_input_from_json(const char *text, const hapi_profile *profile,
                                hapi_policy_input *out, hapi_error *err);

/*
 * Parses a link rate: a number and a unit, bits ("100Mbit", "1Gbit", "10gbit",
 * "1.5Gbit/s", "800kbit") or bytes per second ("125MB/s", "1GiB/s"); k/M/G/T
 * are powers of 1000, Ki/Mi/Gi of 1024. A bare number has no unit and is
 * refused, as is "mbps" (bits or bytes?). Returns 0 or HAPI_EINVAL (says why).
 */
int hapi_policy_parse_rate(const char *text, double *bits_per_s, hapi_error *err);

/* Writes a rate readably ("1 Gbit/s", "100 Mbit/s") into buf. */
void hapi_policy_format_rate(double bits_per_s, char *buf, size_t size);

/* ------------------------------------------------------------------ inputs */

/*
 * The policy's inputs an operator gives (mount options, .hapifs/ctl commands,
 * hapifs-ctl set-*): one table (policy/inputs.c) says for each its meaning,
 * unit, range and parser, so that every place takes the same values and
 * refuses the others with the same message.
 */
enum hapi_policy_input_kind {
    HAPI_INPUT_RATE,    /* a link rate (hapi_policy_parse_rate), in bits/s */
    HAPI_INPUT_TIME,    /* a time (hapi_policy_parse_time), in seconds */
    HAPI_INPUT_SIZE,    /* a size (hapi_policy_parse_size), in bytes */
    HAPI_INPUT_FLOAT,   /* a decimal number */
    HAPI_INPUT_INT,     /* a whole number */
    HAPI_INPUT_ENUM,    /* one of the words of hapi_policy_input_spec.words: its index */
    HAPI_INPUT_MS_LIST  /* comma-separated numbers, 1..HAPI_PROFILE_MAX_STAGES of them, each
                           in range */
};

/* One input of the table. Every string is static. */
typedef struct hapi_policy_input_spec {
    const char *name;    /* the mount option name= and the control command "name VALUE" */
    const char *meaning; /* what it tells the policy */
    const char *unit;    /* of the parsed value: "bit/s", "s", "bytes", "ms", "times", ... */
    int kind;            /* enum hapi_policy_input_kind */
    double min, max;     /* the range in unit, both included (ENUM: none) */
    const char *range;   /* the same range as users write it ("1kbit/s..10Tbit/s"); its two
                            ends parse to min and max */
    const char *words;   /* ENUM: the choices ("file|pack"); otherwise a word taken instead
                            of a value ("default", "none"), or NULL */
    const char *why;     /* why these limits */
    int mount_option;    /* 1: also a mount option (-o name=VALUE) */
    const char *value;   /* a value in a usage line: "RATE", "N", "file|pack" */
    const char *fallback; /* what the policy takes when the input is not given, as users
                            write it ("1Gbit", "file", "none"); it parses to that default */
} hapi_policy_input_spec;

/* A value parsed and checked against its spec. */
typedef struct hapi_policy_input_value {
    const hapi_policy_input_spec *spec; /* borrowed from the table: lives for the program */
    int is_word;         /* spec->words given instead of a value (not for ENUM): number is -1,
                            count 0 */
    double number;       /* in spec->unit (INT: a whole number; ENUM: the word's index) */
    int count;           /* MS_LIST: the numbers in list */
    double list[HAPI_PROFILE_MAX_STAGES];
} hapi_policy_input_value;

/* The table: *count entries (count may be NULL). Static; safe from any thread. */
const hapi_policy_input_spec *hapi_policy_input_specs(size_t *count);

/* The spec of the input called name, or NULL: not an input of the table. */
const hapi_policy_input_spec *hapi_policy_input_find(const char *name);

/*
 * The help text of an input, from its row of the table: "MEANING: RANGE[ UNIT][, or WORD]
 * (default FALLBACK)", the unit shown where the range does not end in one ("0..1000 ms",
 * "1..100000 epochs"); an ENUM, whose words are its value: "MEANING (default FALLBACK)".
 * Writes at most size bytes, NUL included, into buf; returns the length of the whole text,
 * as snprintf does. Thread-safe.
 */
int hapi_policy_input_help(const hapi_policy_input_spec *s, char *buf, size_t size);

/* ------------------------------------------------------------ precision=auto */

/*
 * precision=auto: the arithmetic a mount's model runs in, chosen by measuring the candidates
 * on this node: fp32, bf16 and int8 (enum hapi_precision), each loaded as its precision= would
 * load it (bf16 with its check, int8 calibrated and checked, with HAPI_PRECISION_MIN_COSINE
 * as the bound at the freeze point). A candidate whose features at the freeze point (stage
 * to - 1: what training reads) fall below HAPI_PRECISION_MIN_COSINE of fp32's at its check is
 * not timed.
 * The others run stages [0, to) on HAPI_PRECISION_BATCH random samples of the probed shape,
 * HAPI_PRECISION_WARMUPS times each to warm up (TorchScript's executor specialises a graph on
 * its first runs), then HAPI_PRECISION_ROUNDS rounds taking turns. A candidate is pruned as
 * soon as it is clearly slower than the fastest left: its last warm-up over
 * HAPI_PRECISION_PRUNE_WARMUP times the fastest (what is left of one-time costs differs by
 * precision), or its best timed batch over HAPI_PRECISION_PRUNE times the fastest best. Of those left, the
 * choice starts at the most exact (fp32, then bf16, then int8) and moves to a less exact one
 * whose median is at most HAPI_PRECISION_MARGIN of the choice's: fp32 is the reference, and a
 * coarser arithmetic must pay for its rounding.
 */
#define HAPI_PRECISION_CANDIDATES 3 /* fp32, bf16, int8: enum hapi_precision's values */
#define HAPI_PRECISION_BATCH 8
#define HAPI_PRECISION_WARMUPS 2
#define HAPI_PRECISION_ROUNDS 3
#define HAPI_PRECISION_PRUNE_WARMUP 3.0 /* one-time costs differ: bf16 56, int8 19.7 ms */
#define HAPI_PRECISION_PRUNE 1.5
#define HAPI_PRECISION_MARGIN 0.95
#define HAPI_PRECISION_MIN_COSINE 0.999

/* What became of a candidate. */
enum hapi_candidate_state {
    HAPI_CANDIDATE_ABSENT = 0,  /* not loaded (does not load on this node or device) */
    HAPI_CANDIDATE_TIMED = 1,   /* timed to the end */
    HAPI_CANDIDATE_PRUNED = 2,  /* clearly slower than another: pruned */
    HAPI_CANDIDATE_BELOW = 3    /* below HAPI_PRECISION_MIN_COSINE at its check: not timed */
};

typedef struct hapi_precision_candidate {
    int state;            /* enum hapi_candidate_state */
    double ms;            /* per sample, median of the timed runs; 0: none timed */
    double warmup_ms;     /* per sample, the last warm-up run; 0: not run */
    int runs;             /* timed runs */
    double seconds;       /* spent running it here, warm-up included */
    double setup_seconds; /* spent loading it, with its check or calibration (the caller's) */
    int moved;            /* stages of [0, to) it runs in fp32 (moved by its check, or with
                             nothing to quantize) */
    double min_cosine;    /* the lowest check cosine of [0, to) against fp32 (1 for fp32) */
    double cosine;        /* the check cosine at stage to - 1, the freeze point (1 for fp32) */
} hapi_precision_candidate;

typedef struct hapi_precision_choice {
    int precision;        /* enum hapi_precision chosen */
    int stored;           /* read from the cache directory, not measured this mount */
    int batch;            /* samples a timed run */
    int to;               /* stages [0, to) timed */
    hapi_precision_candidate c[HAPI_PRECISION_CANDIDATES]; /* by enum hapi_precision */
    double seconds;       /* spent on every candidate, loading and running */
    double pruned_seconds; /* of which on the pruned and those below the bound */
    char cpu[96];         /* the CPU measured on (/proc/cpuinfo's model name): a choice
                             read back on another is made again */
    char why[384];        /* what was done with each candidate, and why the choice */
} hapi_precision_choice;

/*
 * Chooses among the models m (by enum hapi_precision; NULL: absent; m[fp32] is required),
 * loaded from one archive with the same threads and probed at 3 x size x size, over stages
 * [0, to), as described above, and fills *out; setup_seconds (may be NULL) gives what loading
 * each took. Runs on the calling thread. Returns 0, HAPI_EINVAL, -ENOMEM, or a model error
 * (HAPI_EOOM, HAPI_EMODEL).
 */
int hapi_precision_choose(hapi_model *const m[HAPI_PRECISION_CANDIDATES],
                          const double *setup_seconds, int size, int to,
                          hapi_precision_choice *out, hapi_error *err);

/* The choice as JSON text (malloc'd, caller frees), or NULL when out of memory. */
char *hapi_precision_choice_to_json(const hapi_precision_choice *c);

/* Reads a choice stored with hapi_policy_save_text(hapi_precision_choice_to_json()); sets
   stored. Returns 0, -ENOENT (none), or HAPI_EINVAL (unreadable, of an older version, or
   measured on another CPU: says which). */
int hapi_precision_choice_load(const char *path, hapi_precision_choice *out, hapi_error *err);

/*
 * Parses text as the input called name and checks it against the table's range. Fills *out
 * on success. Fails with HAPI_EINVAL and a message that names the input, the value and the
 * range, the same wherever it is given: "epochs 0: expected a whole number in 1..100000" (a
 * rate whose unit is missing or ambiguous says so first). An unknown name is HAPI_EINVAL too.
 * Thread-safe; reads nothing but its arguments and the table.
 */
int hapi_policy_input_parse(const char *name, const char *text, hapi_policy_input_value *out,
                            hapi_error *err);

/*
 * Parses a time: a number and s, ms or us; a bare number is milliseconds, as
 * ping prints it ("1ms", "200us", "0.25s", "2"). Not negative, finite.
 * Returns 0 or HAPI_EINVAL (says why).
 */
int hapi_policy_parse_time(const char *text, double *seconds, hapi_error *err);

/*
 * Parses a size: a number, optionally K, M, G or T (powers of 1024, with or
 * without i and B: "64K", "1.5G", "2GiB", "512MB"); a bare number is bytes.
 * Not negative, below 2^64. Returns 0 or HAPI_EINVAL (says why).
 */
int hapi_policy_parse_size(const char *text, uint64_t *bytes, hapi_error *err);

#ifdef __cplusplus
}
#endif

#endif
