/* extractor.h — turns image files into feature tensors: decode, preprocess, run the frozen stages. */
#ifndef HAPI_EXTRACTOR_H
#define HAPI_EXTRACTOR_H

#include <stddef.h>
#include <stdint.h>

#include "hapi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ images */

/*
 * A decoded image: 8-bit RGB, rows of width * 3 bytes, no padding.
 * pixels is owned by the image; release it with hapi_image_release().
 */
typedef struct hapi_image {
    int width;
    int height;
    uint8_t *pixels;
} hapi_image;

/* Per-thread decoding state (a TurboJPEG handle). Not thread-safe: one per thread. */
typedef struct hapi_decoder hapi_decoder;

/* Creates a decoder. Returns 0, or -ENOMEM / HAPI_EDECODE; *out is NULL on failure. */
int hapi_decoder_new(hapi_decoder **out);

/* Frees a decoder. Accepts NULL. */
void hapi_decoder_free(hapi_decoder *dec);

enum hapi_preprocess_mode {
    HAPI_PREPROCESS_EXACT = 0, /* full decode, PIL-equal resampling */
    HAPI_PREPROCESS_FAST = 1   /* DCT-domain downscale first, then the same resampling */
};

/* The filter of the resize: Pillow's, as torchvision's Resize passes it to a PIL image. */
enum hapi_interpolation {
    HAPI_INTERP_BILINEAR = 0, /* triangle, support 1 (Pillow's BILINEAR) */
    HAPI_INTERP_BICUBIC = 1   /* Keys' cubic with a = -0.5, support 2 (Pillow's BICUBIC) */
};

/*
 * The name of an interpolation as archives and .hapifs/config spell it
 * ("bilinear", "bicubic"): a static string, or NULL for an unknown value.
 */
const char *hapi_interpolation_name(int interpolation);

/* The enum hapi_interpolation of a name, or HAPI_EINVAL for NULL or an unknown name. */
int hapi_interpolation_parse(const char *name);

/*
 * torchvision's Resize(resize, interpolation) -> CenterCrop(crop) -> ToTensor
 * -> Normalize(mean, std). max_pixels refuses images whose header says
 * width * height > max_pixels (0: no limit), before anything is allocated
 * for decoding.
 */
typedef struct hapi_preprocess {
    int resize;
    int crop;
    float mean[3];
    float std[3];
    int mode;
    uint64_t max_pixels;
    int interpolation;   /* enum hapi_interpolation; 0 (bilinear) when left out */
} hapi_preprocess;

/*
 * Decodes JPEG or PNG bytes to RGB like PIL's Image.open(p).convert("RGB")
 * (grayscale, CMYK/YCCK, palette, alpha, 16-bit are converted as PIL does;
 * alpha is dropped). min_short_side > 0 allows a JPEG to be decoded at a
 * reduced DCT scale whose short side is still >= min_short_side (fast mode);
 * 0 decodes at full size.
 * Returns 0, HAPI_EFORMAT, HAPI_EDECODE (truncated or corrupt; message says
 * why), HAPI_ETOOBIG, or -ENOMEM. On failure out->pixels is NULL.
 */
int hapi_image_decode(hapi_decoder *dec, const void *data, size_t size,
                      uint64_t max_pixels, int min_short_side,
                      hapi_image *out, hapi_error *err);

/*
 * Reads an image's dimensions from its header alone (JPEG SOF or PNG IHDR),
 * without decoding or allocating: for memory accounting before a decode.
 * Returns 0, HAPI_EFORMAT or HAPI_EDECODE (no dimensions found). Thread-safe.
 */
int hapi_image_size(const void *data, size_t size, int *width, int *height);

/* Frees img->pixels and zeroes the image. Accepts NULL and an empty image. */
void hapi_image_release(hapi_image *img);

/*
 * Resizes (PIL's pp->interpolation filter with antialiasing, short side to
 * pp->resize, long side truncated), centre-crops to pp->crop x pp->crop,
 * scales to [0, 1] and normalizes, writing 3 * crop * crop floats in CHW
 * order to out. Returns 0, HAPI_EINVAL (bad parameters, unknown
 * interpolation) or -ENOMEM. Thread-safe.
 */
int hapi_image_preprocess(const hapi_image *img, const hapi_preprocess *pp,
                          float *out, hapi_error *err);

/* hapi_image_decode then hapi_image_preprocess, per pp->mode. Same returns. */
int hapi_image_load(hapi_decoder *dec, const void *data, size_t size,
                    const hapi_preprocess *pp, float *out, hapi_error *err);

/* True if name ends in an image extension we serve (.jpg .jpeg .png, any case). */
int hapi_image_name_is_image(const char *name);

/* ------------------------------------------------------------------- model */

/*
 * The C face of the libtorch shim (model.cpp). A staged model is a
 * TorchScript archive whose top module's direct children are the stages, in
 * execution order, with metadata in the extra file "hapifs.json".
 * Every function catches every C++ exception and reports through err.
 */
typedef struct hapi_model hapi_model;

/* The shim's functions never throw; C++ callers see that in their type. */
#ifdef __cplusplus
#define HAPI_NOEXCEPT noexcept
#else
#define HAPI_NOEXCEPT
#endif

enum hapi_dtype { HAPI_DTYPE_FP32 = 0, HAPI_DTYPE_FP16 = 1 };

/* The arithmetic the stages run in; outputs are converted to the asked dtype either way. */
enum hapi_precision {
    HAPI_PRECISION_FP32 = 0, /* the reference */
    HAPI_PRECISION_BF16 = 1, /* weights and activations in bfloat16 (CPU only): oneDNN's
                                AMX / AVX512-BF16 kernels, ~4x faster where the CPU has them */
    HAPI_PRECISION_INT8 = 2  /* convolutions and linear layers in int8 (CPU only, oneDNN's
                                quantized engine), calibrated on sample images
                                (hapi_model_calibrate); stage inputs and outputs in fp32 */
};

/* A precision as options, logs and .hapifs/config spell it: "bf16", "int8", else "fp32". */
const char *hapi_precision_name(int precision);

#define HAPI_MAX_DIMS 8
#define HAPI_STAGE_NAME_MAX 64

/* One stage: its name and the shape of its output for one sample (no batch dimension). */
typedef struct hapi_stage_info {
    char name[HAPI_STAGE_NAME_MAX];
    int ndim;
    int64_t shape[HAPI_MAX_DIMS];
    uint64_t param_bytes;   /* its weights and buffers, as loaded */
    int precision;          /* enum hapi_precision it runs in: the model's, but where a bf16
                               model's check moved it to fp32 (HAPI_BF16_MIN_COSINE) */
    double check_cosine;    /* of a bf16 model after probe, of an int8 one after calibration:
                               the lowest cosine of the stage's output as the model runs
                               against fp32's on the check's samples; 0 else (and for an int8
                               stage with nothing to quantize) */
} hapi_stage_info;

/*
 * A bf16 model's probe runs every stage in fp32 and as the model runs on seeded image-like
 * inputs of the probed shape; while a stage's output is below this cosine of fp32's, a stage
 * moves to fp32 for good: that one if it runs in bf16, else the last bf16 one before it. The
 * features of every split stay within 0.999 of fp32's with a margin for images unlike the
 * check's.
 */
#define HAPI_BF16_MIN_COSINE 0.9995

/*
 * An int8 model's calibration quantizes each stage on fp32's inputs to it for the calibration
 * samples, and keeps the stage in int8 while the model's output there stays at this cosine or
 * more of fp32's on those samples; else (or where nothing in it quantizes) the stage runs in
 * fp32. Samples: the first HAPI_INT8_CALIBRATION_IMAGES images of the mount's source.
 */
#define HAPI_INT8_MIN_COSINE 0.995
#define HAPI_INT8_CALIBRATION_IMAGES 32

typedef struct hapi_model_options {
    const char *device;  /* "cpu" (default when NULL or "") or "cuda[:N]" */
    int threads;         /* intra-op threads, process-wide (libtorch's setting); the
                            first load with threads > 0 also sizes the inter-op pool;
                            0 = leave libtorch's choice (the physical core count) */
    int optimize;        /* nonzero: freeze and optimize_for_inference each stage
                            (batch-norm folded: outputs change in the last digits;
                            load takes longer, inference is faster) */
    int precision;       /* enum hapi_precision; bf16 and int8 are refused on CUDA */
} hapi_model_options;

/*
 * Loads a staged model archive. Checks that it is staged (a TorchScript
 * archive with hapifs.json and at least one child module, each with a
 * forward method) but runs nothing; it does not parse hapifs.json.
 * opt may be NULL (cpu, default threads, no optimize).
 * Returns 0, -ENOENT/-EACCES/-EISDIR (unusable path), HAPI_ENOTSTAGED (not a
 * TorchScript archive, or no hapifs.json, or no stages: the message says
 * which), HAPI_EINVAL (bad or unavailable device), HAPI_EMODEL (libtorch
 * could not load an archive), HAPI_EOOM.
 * *out is NULL on failure; free with hapi_model_free().
 */
int hapi_model_load(const char *path, const hapi_model_options *opt,
                    hapi_model **out, hapi_error *err) HAPI_NOEXCEPT;

/* Frees a model. Accepts NULL. */
void hapi_model_free(hapi_model *m) HAPI_NOEXCEPT;

/* The archive's hapifs.json text; lives as long as m. */
const char *hapi_model_metadata(const hapi_model *m) HAPI_NOEXCEPT;

/* Number of stages. */
int hapi_model_num_stages(const hapi_model *m) HAPI_NOEXCEPT;

/*
 * Runs one zero sample of shape (channels, height, width) through every stage
 * to learn each stage's output shape (each must return a tensor of its
 * precision, float32 or bfloat16, whose first dimension is the batch). Must be called once before
 * hapi_model_stage() reports shapes and before hapi_model_run(); not while
 * another thread uses m. On failure the model keeps its previous state.
 * The first probe of a bf16 model also checks its outputs against fp32's
 * (HAPI_BF16_MIN_COSINE): it runs the model once in fp32 and once or more as it
 * will run; an fp32 copy of the weights, kept since the load, is freed after.
 * Returns 0, HAPI_EINVAL, HAPI_EMODEL (a stage failed: the message names it),
 * HAPI_EOOM.
 */
int hapi_model_probe(hapi_model *m, int channels, int height, int width,
                     hapi_error *err) HAPI_NOEXCEPT;

/*
 * Quantizes an int8 model: n samples of the probed input shape (CHW fp32, batch-major) run
 * through each stage in fp32 and quantized; stages that would not keep every stage's features
 * within HAPI_INT8_MIN_COSINE of fp32's, and stage at's (when at >= 0) within min_cosine too,
 * or that hold nothing to quantize, stay fp32. After hapi_model_probe(), before
 * hapi_model_run(), once, not while another thread uses m; until then an int8 model runs in
 * fp32. The fp32 copy of the weights kept since the load is freed after. Returns 0,
 * HAPI_EINVAL (not an int8 model, not probed, calibrated already, n < 1, min_cosine outside
 * 0..1, at past the last stage), HAPI_EMODEL,
 * HAPI_EOOM.
 */
int hapi_model_calibrate(hapi_model *m, const float *samples, int n, double min_cosine, int at,
                         hapi_error *err) HAPI_NOEXCEPT;

/*
 * Describes stage index (0-based). Names are known after load; shapes after
 * hapi_model_probe() (ndim is 0 before). Returns 0 or HAPI_EINVAL.
 */
int hapi_model_stage(const hapi_model *m, int index, hapi_stage_info *info) HAPI_NOEXCEPT;

/*
 * Appends " fp32_stages=I,J" to buf (NUL-terminated, size bytes in all), naming
 * the stages in [from, to) that a bf16 model's check moved to fp32; nothing when
 * there are none (and for an fp32 model). For a cache namespace's description:
 * such features are not those of the same split all in bf16.
 */
void hapi_model_append_fp32_stages(const hapi_model *m, int from, int to, char *buf,
                                   size_t size);

/*
 * Sets how many threads the calling thread's later inferences use (OpenMP's
 * per-thread count; the load's threads stay the default of other threads).
 * Cheap: no cache is cleared. n < 1 is ignored.
 */
void hapi_model_set_threads(int n);

/*
 * The BLAS that libtorch's linear layers call, named by the directory of the
 * libblas.so.3 this process loaded (Debian's alternatives): "reference" (the
 * netlib reference implementation, Debian's "blas"), "openblas-pthread",
 * "openblas-openmp", "blis-openmp", ...; "unknown" when none can be found.
 * Timing depends on it: profiles are kept per BLAS. A static string.
 */
const char *hapi_model_blas(void);

/*
 * Runs stages [0, split) (1 <= split <= num_stages) on batch samples of the
 * probed input shape (CHW fp32, contiguous, batch-major) and writes the
 * output of stage split - 1 to output as dtype (enum hapi_dtype; fp16 is
 * the stage's output rounded to nearest; a bf16 model casts the input
 * first), batch-major, contiguous. output_size must be at least batch * (elements per sample) * (2 or 4) bytes. input is read in
 * place, not copied, and not modified; both buffers stay the caller's.
 * Thread-safe: several threads may run one model at once.
 * Returns 0, HAPI_EINVAL (not probed, bad split, batch, dtype or size),
 * HAPI_EOOM (out of memory: a smaller batch may succeed), HAPI_EMODEL (a
 * stage failed: the message names it).
 */
int hapi_model_run(hapi_model *m, int split, const float *input, int batch,
                   int dtype, void *output, size_t output_size, hapi_error *err) HAPI_NOEXCEPT;

/*
 * Runs stages [from, to) (0 <= from < to <= num_stages) on batch samples of
 * what stage from - 1 outputs, in its probed shape (from = 0: the probed
 * input shape), given as in_dtype (HAPI_DTYPE_FP32, or FP16 as a mount
 * stores them), batch-major, contiguous; writes stage to - 1's output as
 * hapi_model_run() does. A feature of split s run through [s, to) equals
 * hapi_model_run(to) on its image but for the rounding of the feature's dtype
 * (fp16) and of the model's precision. Same rules and codes as hapi_model_run().
 */
int hapi_model_run_range(hapi_model *m, int from, int to, const void *input, int in_dtype,
                         int batch, int dtype, void *output, size_t output_size,
                         hapi_error *err) HAPI_NOEXCEPT;

/* Called by hapi_model_measure() just before (after = 0) and after (1) stage runs. */
typedef void (*hapi_model_hook_fn)(void *ctx, int stage, int after);

/*
 * Runs every stage once, in order, on batch samples of random input of the
 * probed shape (each stage on the previous one's output), and writes each
 * stage's own wall time to stage_ns[0 .. num_stages). hook (may be NULL) runs
 * outside the timed part around every stage, e.g. to measure memory.
 * Not while another thread probes m; runs alongside hapi_model_run().
 * Returns 0, HAPI_EINVAL (not probed, bad batch), HAPI_EOOM, HAPI_EMODEL.
 */
int hapi_model_measure(hapi_model *m, int batch, hapi_model_hook_fn hook, void *ctx,
                       uint64_t *stage_ns, hapi_error *err) HAPI_NOEXCEPT;

/* --------------------------------------------------------------- extractor */

/* Where a mount's features come from: a model, a split, a dtype, a preprocessing. */
typedef struct hapi_extractor_config {
    const char *model_path;
    const char *split;      /* "auto", a stage count N (runs [0, N)), or a stage name (runs through it) */
    const char *freeze;     /* NULL/"" = the model's default; N or NAME as split */
    int dtype;              /* enum hapi_dtype */
    int mode;               /* enum hapi_preprocess_mode */
    uint64_t max_pixels;    /* 0 = no limit */
    int threads;            /* libtorch intra-op threads, 0 = default */
    const char *device;     /* NULL = "cpu" */
    int precision;          /* enum hapi_precision */
    const char *calibrate_dir; /* int8: its first images calibrate (NULL/"" or none there:
                                  seeded image-like samples) */
    double int8_min_cosine; /* int8: the calibration's bound at the freeze point (every stage
                               keeps HAPI_INT8_MIN_COSINE); 0: HAPI_INT8_MIN_COSINE */
} hapi_extractor_config;

/* How an int8 model was calibrated. */
typedef struct hapi_calibration {
    int images;             /* of calibrate_dir; 0: HAPI_INT8_CALIBRATION_IMAGES seeded samples */
    uint8_t digest[16];     /* XXH3-128 of the preprocessed samples: part of the namespace */
    double seconds;         /* the quantization's time */
    double min_cosine;      /* the bound the freeze point's features kept (every stage's:
                               HAPI_INT8_MIN_COSINE) */
} hapi_calibration;

typedef struct hapi_extractor hapi_extractor;

/* The model's metadata (hapifs.json), parsed. */
typedef struct hapi_model_meta {
    char arch[64];
    int input_size;       /* crop size */
    int resize_size;      /* Resize() target */
    float mean[3];
    float std[3];
    int freeze;           /* default freeze index: stages [0, freeze) are frozen */
    int version;          /* of hapifs.json: 1 or 2 */
    int interpolation;    /* enum hapi_interpolation: version 2 names it, version 1 is bilinear */
    char weights[320];    /* "random:seed=N", "file:NAME", ...; "" when not recorded */
    char weights_enum[128]; /* a torchvision weights enum, e.g. "ResNet50_Weights.IMAGENET1K_V2";
                               "" when not recorded */
} hapi_model_meta;

/*
 * Keeps the memory of freed tensors in this process for the next batch (process-wide; call
 * before the threads that run models start). By default glibc maps every block above its mmap
 * threshold (128 KiB, rising to at most 32 MiB) on its own and unmaps it when freed, and gives
 * back a thread's heap (64 MiB at most) once it is free: a batch's activations were faulted in
 * page by page again at every batch. Measured here with 1 thread at 224 px: model-time,
 * ResNet-50 at batch 32, 270 ms an image that way against 55 with the heap kept, VGG-16 at 16
 * 549 against 177; a mount's inference thread (ResNet-50 to pool, batches of 14) 276 against
 * 82 ms a sample. Every block then comes from one heap (no mmap for allocations, one arena),
 * whose top goes back to the kernel only beyond keep_bytes free (at most INT_MAX): what the
 * process holds is its high-water mark, which mem= bounds.
 */
void hapi_extractor_keep_heap(uint64_t keep_bytes);

/*
 * Loads and probes the model, parses its metadata, resolves split and freeze
 * and digests the model file. Returns 0, -errno for an unreadable file,
 * HAPI_ENOTSTAGED (also for metadata of an unknown version or naming an
 * unknown interpolation), HAPI_EMODEL, HAPI_EINVAL (bad split/freeze: the message
 * names the stages that exist). *out is NULL on failure; free with
 * hapi_extractor_close().
 */
int hapi_extractor_open(const hapi_extractor_config *cfg, hapi_extractor **out,
                        hapi_error *err);

/* Frees an extractor. Accepts NULL. */
void hapi_extractor_close(hapi_extractor *ex);

/*
 * Parses a split or freeze word ("N" or a stage name) against ex's model:
 * returns the stage count in 1..num_stages, or HAPI_EINVAL with a message.
 */
int hapi_extractor_parse_split(const hapi_extractor *ex, const char *word, hapi_error *err);

/* Accessors; pointers live as long as ex. */
const hapi_model_meta *hapi_extractor_meta(const hapi_extractor *ex);
hapi_model *hapi_extractor_model(const hapi_extractor *ex);
const hapi_preprocess *hapi_extractor_preprocess(const hapi_extractor *ex);
int hapi_extractor_split(const hapi_extractor *ex);   /* stages run: [0, split) */
int hapi_extractor_freeze(const hapi_extractor *ex);
int hapi_extractor_dtype(const hapi_extractor *ex);
/* Output stage of the split (shape per sample). */
const hapi_stage_info *hapi_extractor_output(const hapi_extractor *ex);
/* Bytes of one sample's features: elements * (2 or 4). */
size_t hapi_extractor_sample_bytes(const hapi_extractor *ex);
/* The same at another split (1..num_stages), in ex's dtype; 0 for a bad split. */
size_t hapi_extractor_split_bytes(const hapi_extractor *ex, int split);
/* An int8 model's calibration; zeros for another precision. */
const hapi_calibration *hapi_extractor_calibration(const hapi_extractor *ex);
/* XXH3-128 of the model file's bytes. */
const uint8_t *hapi_extractor_model_digest(const hapi_extractor *ex);

/* XXH3-128 of a file's bytes (read in chunks, so a large model never sits twice in memory),
   as hapi_extractor_model_digest() gives it. Returns 0, -errno or -ENOMEM (says which). */
int hapi_file_digest(const char *path, uint8_t digest[16], hapi_error *err);

/*
 * Decodes, preprocesses and runs one image's bytes, writing
 * hapi_extractor_sample_bytes() bytes to out. dec is the calling thread's
 * decoder. Thread-safe given one decoder per thread.
 * Returns 0 or an error from decode, preprocess or model run.
 */
int hapi_extractor_compute(hapi_extractor *ex, hapi_decoder *dec,
                           const void *data, size_t size, void *out,
                           hapi_error *err);

/* -------------------------------------------------------------------- node */

/*
 * What the mounts of one node share, through a file every daemon maps
 * (/run/hapifs/node): a memory budget, from which each daemon holds its
 * model's share while mounted and draws its images and tensors in flight;
 * and the cores, divided among the mounts busy computing, so that 20 mounts
 * on 2 cores run 20 inference threads, not 40, and a profile runs alone. A dead daemon's share is taken
 * back by the next daemon that finds it (its slot names pid and start time).
 */
typedef struct hapi_node hapi_node;

#ifdef __cplusplus
typedef int hapi_stop_flag; /* the C++ shim does not call these */
#else
typedef _Atomic int hapi_stop_flag; /* set once to cancel a wait */
#endif

typedef struct hapi_node_config {
    const char *path;   /* the node file, created if missing */
    uint64_t mem_total; /* the node budget in bytes: 0 keeps the file's (new: half the RAM) */
    int cores;          /* core tokens: 0 keeps the file's (new: the online CPUs) */
    const char *name;   /* this daemon's mountpoint, shown to others */
} hapi_node_config;

typedef struct hapi_node_stats {
    uint64_t mem_total, mem_used;     /* the node budget, and what its mounts hold */
    uint64_t cores, cores_used;       /* the node's cores, and threads inferences run now */
    uint64_t mounts, waiting;         /* daemons joined; profiles waiting for the cores */
    uint64_t reaped;                  /* slots of dead daemons taken back */
    uint64_t own_fixed, own_flight;   /* this daemon's model share and bytes in flight */
    uint64_t own_waits;               /* times this daemon waited for memory or cores */
} hapi_node_stats;

/*
 * Opens (creating) the node file and joins it: *out is this daemon's place
 * until hapi_node_close(). A mem_total or cores given replaces the file's.
 * Returns 0 or -errno with err (e.g. -EACCES: not root; the caller runs
 * without a node then).
 */
int hapi_node_open(const hapi_node_config *cfg, hapi_node **out, hapi_error *err);

/* Leaves the node: gives back everything this process holds. Accepts NULL. */
void hapi_node_close(hapi_node *n);

/* Sets what this daemon holds while mounted (its model's weights and working memory). */
void hapi_node_set_fixed(hapi_node *n, uint64_t bytes);

/*
 * Draws bytes in flight from the node budget, waiting while the node is full;
 * a daemon with nothing in flight may go over, so every mount progresses.
 * Returns 0, or -ECANCELED once *stop is set. n NULL: returns 0 at once.
 */
int hapi_node_mem_take(hapi_node *n, uint64_t bytes, const hapi_stop_flag *stop);
void hapi_node_mem_give(hapi_node *n, uint64_t bytes);

/*
 * Threads for an inference: want, but no more than the node's cores divided
 * among the mounts busy computing (those running an inference, or that ran
 * one within the last second), and at least one; it does not wait, but while
 * a mount profiles (or waits to) nobody starts. With alone set (a profile):
 * waits, first come first served among profiles, until no inference runs and
 * takes every core. Returns the count (the inference runs that many threads,
 * hapi_model_set_threads(); give it back with hapi_node_cores_give()), 0 with
 * n NULL, or -ECANCELED once *stop is set.
 */
int hapi_node_cores_take(hapi_node *n, int want, int alone, const hapi_stop_flag *stop);
void hapi_node_cores_give(hapi_node *n, int count);

/* Fills *st (zeros with n NULL). */
void hapi_node_stats_get(hapi_node *n, hapi_node_stats *st);

/* ----------------------------------------------------------------- batcher */

/*
 * The batcher decouples the storage-side batch from reads. One read asks for
 * one sample (a key: the source path); the batcher gathers demand reads,
 * prefetch and warm-up into batches of the configured size, decodes on a
 * pool of threads while the previous batch is in inference, and hands each
 * finished batch to a sink (the cache: one write transaction per batch).
 * A sample is computed once however many readers want it.
 */
typedef struct hapi_batcher hapi_batcher;
typedef struct hapi_ticket hapi_ticket;

enum hapi_priority {
    HAPI_PRIORITY_DEMAND = 0,   /* a reader is waiting */
    HAPI_PRIORITY_PREFETCH = 1, /* a reader will probably want it soon */
    HAPI_PRIORITY_WARM = 2,     /* background warm-up */
    HAPI_PRIORITY_COUNT = 3
};

#define HAPI_BATCHER_TAG_MAX 64

/*
 * Reads the source bytes of key, on a decode thread. Fills *data (malloc'd;
 * the batcher frees it) and *size, and may fill tag (tag_size bytes, e.g.
 * the identity of the file the bytes were read from), which is handed back
 * with the result. Returns 0 or a negative code with a message in err.
 */
typedef int (*hapi_batcher_load_fn)(void *ctx, const char *key, void **data, size_t *size,
                                    void *tag, hapi_error *err);

/* One sample of a finished batch; features is NULL when code < 0. */
typedef struct hapi_batch_result {
    const char *key;
    const void *tag;
    const void *features;   /* hapi_extractor_sample_bytes() bytes */
    int code;
    const char *message;    /* why it failed, when code < 0 */
    int priority;           /* its priority when it ran */
    int origin;             /* the priority it was first asked for */
    /*
     * How many requests of each priority it answers: the first and every one
     * that joined it (a warm-up counts its own by these, joined or not). A
     * request that comes once the sample is delivered is not among them:
     * hapi_batcher_submit() says so (HAPI_BATCHER_DELIVERED).
     */
    unsigned requests[HAPI_PRIORITY_COUNT];
} hapi_batch_result;

/*
 * Receives every finished sample before any waiter is woken (so a sink that
 * stores them makes later lookups hit): a batch's successes and failures on
 * the inference thread, and a sample that failed to load or decode alone, on
 * its decode thread. So it may run on several threads at once. Pointers live
 * for the call.
 */
typedef void (*hapi_batcher_sink_fn)(void *ctx, const hapi_batch_result *results, size_t n);

#define HAPI_BATCH_MAX 4096

#define HAPI_BATCHER_WORKERS_MAX 64

typedef struct hapi_batcher_config {
    int batch;               /* samples per inference, 1..HAPI_BATCH_MAX */
    int split;               /* stages [0, split) run; 0 = the extractor's split */
    int max_wait_us;         /* how long a partial batch waits for more demand */
    int decode_threads;      /* >= 1 */
    int workers;             /* inference threads, each running its own batches with its
                                share of node_cores (at least 1 thread); 0 = 1, at most
                                HAPI_BATCHER_WORKERS_MAX */
    uint64_t mem_budget;     /* bytes of in-flight source bytes, images and tensors; 0 = none */
    size_t tag_size;         /* <= HAPI_BATCHER_TAG_MAX */
    hapi_batcher_load_fn load;
    hapi_batcher_sink_fn sink;
    void *ctx;
    hapi_node *node;         /* the node's shared budget and cores (borrowed); NULL: none */
    int node_cores;          /* core tokens an inference holds (its torch threads) */
    int fault_decoders_fail; /* testing: this many decode threads fail to create their
                                decoder, as on out-of-memory (0 = none) */
    int fault_oom_above;     /* testing: an inference of more samples fails as out of
                                memory, as libtorch's would (0 = never) */
} hapi_batcher_config;

/*
 * Starts the decode threads and the inference threads over ex (borrowed: it
 * must outlive the batcher), and returns once every decode thread has made
 * its decoder or failed to: the batcher runs with those that did (stats
 * say how many). Returns 0, HAPI_EINVAL, -ENOMEM (no decode thread has a
 * decoder) or -errno; *out NULL on failure. Free with hapi_batcher_free().
 */
int hapi_batcher_new(hapi_extractor *ex, const hapi_batcher_config *cfg, hapi_batcher **out,
                     hapi_error *err);

/*
 * Refuses new work and wakes everything that waits (hapi_batcher_throttle()
 * returns -ECANCELED), without freeing: lets a caller's own threads that use
 * the batcher finish before hapi_batcher_free(). Idempotent.
 */
void hapi_batcher_stop(hapi_batcher *b);

/*
 * Stops, joins the threads and frees. Samples not yet finished fail with
 * -ECANCELED. No ticket may be outstanding. Accepts NULL.
 */
void hapi_batcher_free(hapi_batcher *b);

/*
 * Asks for key at priority. If key is already queued or running, the request
 * joins it (and raises its priority if this one is higher) instead of
 * queueing it twice. With ticket non-NULL, *ticket is a claim on the result
 * to wait on and release; with NULL, the request is fire-and-forget.
 * Returns 0, HAPI_BATCHER_DELIVERED (it joined a sample whose result the sink
 * has had already: the ticket, if any, is as good, but no result will count
 * this request), -ENOMEM, -ECANCELED (shutting down).
 */
#define HAPI_BATCHER_DELIVERED 1
int hapi_batcher_submit(hapi_batcher *b, const char *key, int priority, hapi_ticket **ticket);

/*
 * Waits for the sample. Returns 0 with *features (sample bytes) and *tag
 * valid until hapi_ticket_release(), or the sample's error code with err
 * filled. Thread-safe.
 */
int hapi_ticket_wait(hapi_batcher *b, hapi_ticket *t, const void **features, const void **tag,
                     hapi_error *err);

/* Gives up a claim. Accepts NULL. */
void hapi_ticket_release(hapi_batcher *b, hapi_ticket *t);

/*
 * Blocks while more than limit fire-and-forget requests of priority are
 * queued (so a warm-up walker feeds the queue without flooding it). Returns
 * 0, -ECANCELED when the batcher shuts down, or -EINTR when
 * hapi_batcher_wake() was called meanwhile (the caller checks why, e.g. its
 * own stop flag, and waits again or gives up). Thread-safe.
 */
int hapi_batcher_throttle(hapi_batcher *b, int priority, size_t limit);

/*
 * Makes every hapi_batcher_throttle() now waiting return -EINTR: lets a
 * walker that waits for queue room be stopped without waiting for a batch,
 * which on a slow model can take seconds. Thread-safe.
 */
void hapi_batcher_wake(hapi_batcher *b);

typedef struct hapi_batcher_stats {
    uint64_t queued[HAPI_PRIORITY_COUNT]; /* waiting for a decode thread */
    uint64_t in_flight;                   /* being decoded, or decoded and waiting for a
                                             batch (not the batch in inference) */
    uint64_t decoders;                    /* decode threads running */
    uint64_t samples;                     /* computed successfully */
    uint64_t failed;                      /* failed to load, decode or run */
    uint64_t batches;                     /* inferences run */
    uint64_t joined;                      /* requests that joined one already there */
    uint64_t promoted;                    /* ... and raised its priority */
    uint64_t oom_splits;                  /* batches halved after running out of memory */
    uint64_t decode_ns;                   /* summed over decode threads */
    uint64_t inference_ns;
    uint64_t mem_in_use, mem_peak;        /* accounted bytes */
    uint64_t mem_waits;                   /* times a decode thread waited for the budget */
    int batch;                            /* current batch size */
} hapi_batcher_stats;

/*
 * Sets the batch size for the next inferences (an operator's or the policy's
 * choice; out-of-memory may halve it again). Returns 0 or HAPI_EINVAL.
 */
int hapi_batcher_set_batch(hapi_batcher *b, int batch);

/* Fills *st. Thread-safe. */
void hapi_batcher_stats_get(hapi_batcher *b, hapi_batcher_stats *st);

/* The torch threads of one of `workers` inference workers sharing `threads`: at least 1. */
int hapi_batcher_worker_threads(int threads, int workers);

/* ------------------------------------------------------------------ .npy */

#define HAPI_NPY_HEADER_MAX 256

/*
 * Writes the .npy (format 1.0) header of a C-order array of dtype and shape
 * into buf (at least HAPI_NPY_HEADER_MAX bytes), padded with spaces so that
 * the data starts at a multiple of 64 bytes, as numpy writes it. Every .feat
 * is such a header followed by the features. Returns the header length, or
 * HAPI_EINVAL (unknown dtype, negative dimension, too many dimensions).
 */
int hapi_npy_header(char *buf, int dtype, const int64_t *shape, int ndim);

/*
 * Parses a header as hapi_npy_header() writes it (of a .feat or a pack), at
 * the start of the len bytes of buf: its dtype, shape and ndim (shape holds
 * HAPI_MAX_DIMS). Returns the header length, -EAGAIN when buf ends before
 * it does, or HAPI_EINVAL (not such a header).
 */
int hapi_npy_parse(const char *buf, size_t len, int *dtype, int64_t *shape, int *ndim);

#ifdef __cplusplus
}
#endif

#endif
