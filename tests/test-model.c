/* test-model.c — check suite for the libtorch shim (hapi_model_*) and the extractor object. */
#include "extractor.h"

#include <check.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define PYTHON "/usr/bin/python3"

/* Fixtures made once by main() before the suite forks; the tests only read them. */
static char tmpdir[] = "/tmp/hapi-test-model-XXXXXX";
static char r18_path[PATH_MAX];      /* resnet18 @64, seed 0 */
static char r18_copy_path[PATH_MAX]; /* a byte copy of it */
static char r18_other_path[PATH_MAX]; /* the same model saved with other metadata */
static char vit_path[PATH_MAX];      /* vit_b_16 @32 */
static char plain_path[PATH_MAX];    /* TorchScript archive without hapifs.json */
static char badmeta_path[PATH_MAX];  /* staged archive whose hapifs.json lacks fields */
static char text_path[PATH_MAX];     /* not an archive at all */

/* resnet18 @64 stages and their per-sample output shapes. */
static const struct {
    const char *name;
    int ndim;
    int64_t shape[3];
} r18_stages[] = {
    {"stem", 3, {64, 16, 16}},   {"layer1", 3, {64, 16, 16}}, {"layer2", 3, {128, 8, 8}},
    {"layer3", 3, {256, 4, 4}},  {"layer4", 3, {512, 2, 2}},  {"pool", 1, {512}},
    {"fc", 1, {1000}},
};
#define R18_STAGES 7
#define R18_INPUT (3 * 64 * 64)
#define VIT_INPUT (3 * 32 * 32)

/*
 * Writes the staged model's output for split S on the deterministic input below, computed by
 * TorchScript in Python without freezing, to DIR/ARCH-S.f32 (raw float32), plus the archives
 * the error tests need. argv: DIR R18 VIT.
 */
static const char python_fixtures[] =
    "import collections, json, sys, torch\n"
    "d, r18, vit = sys.argv[1:4]\n"
    "torch.set_grad_enabled(False)\n"
    "def det_input(b, s):\n"
    "    n = b * 3 * s * s\n"
    "    return ((torch.arange(n) % 251).float() / 125.0 - 1.0).reshape(b, 3, s, s)\n"
    "for path, name, size, splits in ((r18, 'r18', 64, (3, 6, 7)), (vit, 'vit', 32, (2, 14))):\n"
    "    m = torch.jit.load(path).eval()\n"
    "    stages = list(m.children())\n"
    "    for split in splits:\n"
    "        x = det_input(2, size)\n"
    "        for st in stages[:split]:\n"
    "            x = st(x)\n"
    "        x.contiguous().numpy().astype('<f4').tofile(f'{d}/{name}-{split}.f32')\n"
    "files = {'hapifs.json': ''}\n"
    "m = torch.jit.load(r18, _extra_files=files)\n"
    "meta = json.loads(files['hapifs.json'])\n"
    "meta['weights'] = 'random:seed=99'\n"
    "torch.jit.save(m, f'{d}/r18-other.pt', _extra_files={'hapifs.json': json.dumps(meta)})\n"
    "plain = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4)))\n"
    "torch.jit.save(plain, f'{d}/plain.pt')\n"
    "torch.jit.save(plain, f'{d}/badmeta.pt', _extra_files={'hapifs.json': json.dumps(\n"
    "    {'format': 'hapifs-staged', 'version': 1, 'stages': ['0']})})\n"
    "tiny = torch.jit.script(torch.nn.Sequential(collections.OrderedDict(\n"
    "    conv=torch.nn.Conv2d(3, 4, 3), pool=torch.nn.AdaptiveAvgPool2d(1))))\n"
    "base = {'format': 'hapifs-staged', 'version': 2, 'arch': 'tiny', 'input_size': 16,\n"
    "        'resize_size': 18, 'mean': [0.5, 0.5, 0.5], 'std': [0.25, 0.25, 0.25],\n"
    "        'stages': ['conv', 'pool'], 'freeze': 2, 'interpolation': 'bilinear'}\n"
    "for name, changes in TINY:\n"
    "    meta = dict(base, **changes)\n"
    "    meta = {k: v for k, v in meta.items() if v is not None}\n"
    "    torch.jit.save(tiny, f'{d}/tiny-{name}.pt',\n"
    "                   _extra_files={'hapifs.json': json.dumps(meta)})\n";

/*
 * Tiny staged archives (a convolution and a pooling, 16x16 input) whose hapifs.json differs
 * from a valid version 2 by the changes given as Python keyword values (None drops the key),
 * saved to DIR/tiny-NAME.pt: the metadata versions and interpolations, accepted and refused.
 */
static const char python_tiny[] =
    "TINY = [\n"
    "    ('bicubic', dict(interpolation='bicubic', weights='random:seed=7',\n"
    "                     weights_enum='EfficientNet_B0_Weights.IMAGENET1K_V1')),\n"
    "    ('bilinear', dict(weights='file:my weights.pth')),\n"
    "    ('v1', dict(version=1, interpolation=None)),\n"
    "    ('v1-says-bilinear', dict(version=1)),\n"
    "    ('v1-bicubic', dict(version=1, interpolation='bicubic')),\n"
    "    ('lanczos', dict(interpolation='lanczos')),\n"
    "    ('no-interpolation', dict(interpolation=None)),\n"
    "    ('interpolation-number', dict(interpolation=3)),\n"
    "    ('v3', dict(version=3)),\n"
    "    ('v0', dict(version=0)),\n"
    "    ('weights-number', dict(weights=7)),\n"
    "]\n";

/* Runs argv[0] with argv and waits; returns its exit status or -1. */
static int run(char *const argv[])
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        execv(argv[0], argv);
        _exit(127);
    }
    int status;
    if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status))
        return -1;
    return WEXITSTATUS(status);
}

static void source_root(char *buf, size_t size)
{
    const char *env = getenv("HAPI_SOURCE_ROOT");
    if (env && *env) {
        snprintf(buf, size, "%s", env);
        return;
    }
    /* BUILD/tests/test-model with BUILD directly under the source root, as in /work/main/build. */
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    exe[n > 0 ? n : 0] = '\0';
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(exe, '/');
        if (slash)
            *slash = '\0';
    }
    snprintf(buf, size, "%s", *exe ? exe : ".");
}

/* ------------------------------------------------------------------ helpers */

static hapi_model *load(const char *path, int optimize)
{
    hapi_error err = {0};
    hapi_model *m = NULL;
    hapi_model_options opt = {.device = NULL, .threads = 2, .optimize = optimize};
    int rc = hapi_model_load(path, &opt, &m, &err);
    ck_assert_msg(rc == 0, "load %s: %d %s", path, rc, err.message);
    ck_assert_ptr_nonnull(m);
    return m;
}

static hapi_model *load_probed(const char *path, int size, int optimize)
{
    hapi_error err = {0};
    hapi_model *m = load(path, optimize);
    int rc = hapi_model_probe(m, 3, size, size, &err);
    ck_assert_msg(rc == 0, "probe: %d %s", rc, err.message);
    return m;
}

static size_t stage_elements(const hapi_model *m, int split)
{
    hapi_stage_info info;
    ck_assert_int_eq(hapi_model_stage(m, split - 1, &info), 0);
    size_t n = 1;
    for (int d = 0; d < info.ndim; d++)
        n *= (size_t)info.shape[d];
    return n;
}

/* The deterministic input the Python fixture uses: ((i % 251) / 125 - 1) in float32. */
static float *det_input(size_t n)
{
    float *v = malloc(n * sizeof(float));
    ck_assert_ptr_nonnull(v);
    for (size_t i = 0; i < n; i++)
        v[i] = (float)(i % 251) / 125.0f - 1.0f;
    return v;
}

/* Output of stages [0, split) on batch samples of in, as fp32; caller frees. */
static float *run_fp32(hapi_model *m, int split, const float *in, int batch)
{
    hapi_error err = {0};
    size_t n = (size_t)batch * stage_elements(m, split);
    float *out = malloc(n * sizeof(float));
    ck_assert_ptr_nonnull(out);
    int rc = hapi_model_run(m, split, in, batch, HAPI_DTYPE_FP32, out, n * sizeof(float), &err);
    ck_assert_msg(rc == 0, "run split %d batch %d: %d %s", split, batch, rc, err.message);
    return out;
}

static float max_abs(const float *v, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++)
        m = fmaxf(m, fabsf(v[i]));
    return m;
}

/* Largest |a - b| relative to max |b|. */
static double max_rel_diff(const float *a, const float *b, size_t n)
{
    double d = 0, scale = max_abs(b, n);
    for (size_t i = 0; i < n; i++)
        d = fmax(d, fabs((double)a[i] - b[i]));
    return scale > 0 ? d / scale : d;
}

static double cosine(const float *a, const float *b, size_t n)
{
    double ab = 0, aa = 0, bb = 0;
    for (size_t i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
        bb += (double)b[i] * b[i];
    }
    return ab / sqrt(aa * bb);
}

/* IEEE binary16 to float, subnormals included. */
static float half_to_float(uint16_t h)
{
    int sign = h >> 15, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
    float v;
    if (exp == 0)
        v = ldexpf((float)frac, -24);
    else if (exp == 31)
        v = frac ? NAN : INFINITY;
    else
        v = ldexpf((float)(frac | 0x400), exp - 25);
    return sign ? -v : v;
}

static float *read_floats(const char *name, size_t n)
{
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
    float *v = malloc(n * sizeof(float));
    ck_assert_ptr_nonnull(v);
    ck_assert_uint_eq(fread(v, sizeof(float), n, f), n);
    ck_assert_int_eq(fgetc(f), EOF);
    fclose(f);
    return v;
}

/* ------------------------------------------------------------------- model */

START_TEST(test_stage_names_and_shapes)
{
    hapi_error err = {0};
    hapi_model *m = load(r18_path, 1);
    hapi_stage_info info;

    ck_assert_int_eq(hapi_model_num_stages(m), R18_STAGES);
    ck_assert_ptr_nonnull(strstr(hapi_model_metadata(m), "\"hapifs-staged\""));
    ck_assert_int_eq(hapi_model_stage(m, 0, &info), 0);
    ck_assert_str_eq(info.name, "stem");
    ck_assert_int_eq(info.ndim, 0); /* not probed yet */

    ck_assert_int_eq(hapi_model_probe(m, 3, 64, 64, &err), 0);
    for (int i = 0; i < R18_STAGES; i++) {
        ck_assert_int_eq(hapi_model_stage(m, i, &info), 0);
        ck_assert_str_eq(info.name, r18_stages[i].name);
        ck_assert_int_eq(info.ndim, r18_stages[i].ndim);
        for (int d = 0; d < info.ndim; d++)
            ck_assert_int_eq(info.shape[d], r18_stages[i].shape[d]);
    }
    ck_assert_int_eq(hapi_model_stage(m, -1, &info), HAPI_EINVAL);
    ck_assert_int_eq(hapi_model_stage(m, R18_STAGES, &info), HAPI_EINVAL);
    hapi_model_free(m);
}
END_TEST

START_TEST(test_vit_shapes)
{
    hapi_model *m = load_probed(vit_path, 32, 0);
    hapi_stage_info info;

    ck_assert_int_eq(hapi_model_num_stages(m), 15);
    ck_assert_int_eq(hapi_model_stage(m, 0, &info), 0);
    ck_assert_str_eq(info.name, "embed");
    ck_assert_int_eq(info.ndim, 2);
    ck_assert_int_eq(info.shape[0], 5); /* 2x2 patches + the class token */
    ck_assert_int_eq(info.shape[1], 768);
    ck_assert_int_eq(hapi_model_stage(m, 12, &info), 0);
    ck_assert_str_eq(info.name, "block11");
    ck_assert_int_eq(info.ndim, 2);
    ck_assert_int_eq(hapi_model_stage(m, 13, &info), 0);
    ck_assert_str_eq(info.name, "head_input");
    ck_assert_int_eq(info.ndim, 1);
    ck_assert_int_eq(info.shape[0], 768);
    ck_assert_int_eq(hapi_model_stage(m, 14, &info), 0);
    ck_assert_str_eq(info.name, "heads");
    ck_assert_int_eq(info.shape[0], 1000);
    hapi_model_free(m);
}
END_TEST

START_TEST(test_batch_equals_singles)
{
    static const int splits[] = {3, 6, 7};
    hapi_model *m = load_probed(r18_path, 64, 1);
    float *in = det_input(3 * R18_INPUT);

    for (size_t s = 0; s < sizeof(splits) / sizeof(splits[0]); s++) {
        size_t per = stage_elements(m, splits[s]);
        float *batch = run_fp32(m, splits[s], in, 3);
        for (int b = 0; b < 3; b++) {
            float *one = run_fp32(m, splits[s], in + (size_t)b * R18_INPUT, 1);
            double rel = max_rel_diff(batch + (size_t)b * per, one, per);
            ck_assert_msg(rel <= 1e-5, "split %d sample %d: rel diff %g", splits[s], b, rel);
            free(one);
        }
        free(batch);
    }
    free(in);
    hapi_model_free(m);
}
END_TEST

START_TEST(test_fp16_is_rounded_fp32)
{
    hapi_error err = {0};
    hapi_model *m = load_probed(r18_path, 64, 1);
    float *in = det_input(2 * R18_INPUT);
    size_t n = 2 * stage_elements(m, 6);
    float *f = run_fp32(m, 6, in, 2);
    uint16_t *h = malloc(n * sizeof(uint16_t));

    ck_assert_ptr_nonnull(h);
    /* Exactly 2 bytes per element suffice for fp16; one fewer is refused. */
    ck_assert_int_eq(hapi_model_run(m, 6, in, 2, HAPI_DTYPE_FP16, h, n * 2 - 1, &err), HAPI_EINVAL);
    ck_assert_int_eq(hapi_model_run(m, 6, in, 2, HAPI_DTYPE_FP16, h, n * 2, &err), 0);
    for (size_t i = 0; i < n; i++) {
        float back = half_to_float(h[i]);
        /* round-to-nearest half: relative error <= 2^-11, absolute <= 2^-25 near zero */
        float tol = fabsf(f[i]) * 0x1p-11f + 0x1p-24f + fabsf(f[i]) * 1e-6f;
        ck_assert_msg(fabsf(back - f[i]) <= tol, "element %zu: fp16 %g vs fp32 %g", i, back, f[i]);
    }
    free(h);
    free(f);
    free(in);
    hapi_model_free(m);
}
END_TEST

/* Parity with TorchScript run from Python, unfrozen, on the same input, at several splits. */
static void check_parity(const char *path, const char *name, int size, const int *splits,
                         int count, int optimize)
{
    hapi_model *m = load_probed(path, size, optimize);
    float *in = det_input((size_t)2 * 3 * size * size);

    for (int i = 0; i < count; i++) {
        char ref_name[64];
        size_t n = 2 * stage_elements(m, splits[i]);
        float *out = run_fp32(m, splits[i], in, 2);
        snprintf(ref_name, sizeof(ref_name), "%s-%d.f32", name, splits[i]);
        float *ref = read_floats(ref_name, n);
        double cos = cosine(out, ref, n), rel = max_rel_diff(out, ref, n);
        ck_assert_msg(cos >= 0.9999 && rel <= 1e-3, "%s split %d optimize %d: cosine %.8f rel %g",
                      name, splits[i], optimize, cos, rel);
        if (getenv("HAPI_TEST_VERBOSE"))
            fprintf(stderr, "parity %s split %d optimize %d: cosine %.9f max rel %.3g\n", name,
                    splits[i], optimize, cos, rel);
        free(ref);
        free(out);
    }
    free(in);
    hapi_model_free(m);
}

START_TEST(test_parity_resnet)
{
    static const int splits[] = {3, 6, 7};
    check_parity(r18_path, "r18", 64, splits, 3, 0);
    check_parity(r18_path, "r18", 64, splits, 3, 1);
}
END_TEST

START_TEST(test_parity_vit)
{
    static const int splits[] = {2, 14};
    /* Optimized only: unoptimized, the shim runs the very graphs Python ran (as for ResNet). */
    check_parity(vit_path, "vit", 32, splits, 2, 1);
}
END_TEST

/* precision bf16: every stage runs in bfloat16; outputs stay close to the fp32 reference. */
START_TEST(test_bf16_close_to_reference)
{
    static const int splits[] = {3, 6, 7};
    hapi_error err = {0};
    hapi_model *m = NULL;
    hapi_model_options opt = {.threads = 2, .optimize = 1, .precision = HAPI_PRECISION_BF16};
    int rc = hapi_model_load(r18_path, &opt, &m, &err);
    ck_assert_msg(rc == 0, "load bf16: %d %s", rc, err.message);
    rc = hapi_model_probe(m, 3, 64, 64, &err);
    ck_assert_msg(rc == 0, "probe bf16: %d %s", rc, err.message);
    float *in = det_input((size_t)2 * R18_INPUT);
    for (size_t i = 0; i < sizeof(splits) / sizeof(splits[0]); i++) {
        char ref_name[64];
        size_t n = 2 * stage_elements(m, splits[i]);
        float *out = run_fp32(m, splits[i], in, 2);
        snprintf(ref_name, sizeof(ref_name), "r18-%d.f32", splits[i]);
        float *ref = read_floats(ref_name, n);
        double cos = cosine(out, ref, n), rel = max_rel_diff(out, ref, n);
        /* bf16 keeps 8 bits of mantissa: close in direction, not in the last digits */
        ck_assert_msg(cos >= 0.995, "bf16 split %d: cosine %.6f", splits[i], cos);
        ck_assert_msg(rel > 1e-6, "bf16 split %d: equal to fp32 (rel %g): not bf16", splits[i], rel);
        if (getenv("HAPI_TEST_VERBOSE"))
            fprintf(stderr, "bf16 split %d: cosine %.6f max rel %.3g\n", splits[i], cos, rel);
        free(ref);
        free(out);
    }
    uint64_t ns[R18_STAGES];
    ck_assert_int_eq(hapi_model_measure(m, 2, NULL, NULL, ns, &err), 0);
    free(in);
    hapi_model_free(m);

    /* an unknown precision is refused */
    opt.precision = 7;
    ck_assert_int_eq(hapi_model_load(r18_path, &opt, &m, &err), HAPI_EINVAL);
    ck_assert_ptr_null(m);
}
END_TEST

/* Output of stages [from, to) on batch samples of in (in_dtype), as fp32; caller frees. */
static float *run_range_fp32(hapi_model *m, int from, int to, const void *in, int in_dtype,
                             int batch)
{
    hapi_error err = {0};
    size_t n = (size_t)batch * stage_elements(m, to);
    float *out = malloc(n * sizeof(float));
    ck_assert_ptr_nonnull(out);
    int rc = hapi_model_run_range(m, from, to, in, in_dtype, batch, HAPI_DTYPE_FP32, out,
                                  n * sizeof(float), &err);
    ck_assert_msg(rc == 0, "run [%d, %d) batch %d: %d %s", from, to, batch, rc, err.message);
    return out;
}

/*
 * A feature of split s run through [s, to) is what [0, to) gives in one go: equal from fp32
 * features, within fp16's rounding from fp16 ones; for maps (ResNet), tokens (ViT), bf16 and
 * int8 (whose one go passes quantized tensors between its stages: it must equal dequantizing
 * at s and quantizing again).
 */
START_TEST(test_run_range_finishes_a_split)
{
    static const struct {
        const char *path;
        int size, input, to, precision;
    } models[] = {
        {r18_path, 64, R18_INPUT, 6, HAPI_PRECISION_FP32},
        {vit_path, 32, VIT_INPUT, 14, HAPI_PRECISION_FP32},
        {r18_path, 64, R18_INPUT, 6, HAPI_PRECISION_BF16},
        {r18_path, 64, R18_INPUT, 6, HAPI_PRECISION_INT8},
    };
    for (size_t k = 0; k < sizeof(models) / sizeof(models[0]); k++) {
        hapi_error err = {0};
        hapi_model *m = NULL;
        hapi_model_options opt = {.threads = 2, .precision = models[k].precision};
        int rc = hapi_model_load(models[k].path, &opt, &m, &err);
        ck_assert_msg(rc == 0, "load: %d %s", rc, err.message);
        ck_assert_int_eq(hapi_model_probe(m, 3, models[k].size, models[k].size, &err), 0);
        int to = models[k].to, bf16 = models[k].precision == HAPI_PRECISION_BF16;
        int int8 = models[k].precision == HAPI_PRECISION_INT8;
        float *in = det_input((size_t)2 * models[k].input);
        if (int8) {
            float *samples = det_input((size_t)8 * models[k].input);
            ck_assert_int_eq(hapi_model_calibrate(m, samples, 8, 1.5, -1, &err), HAPI_EINVAL);
            rc = hapi_model_calibrate(m, samples, 8, 0, -1, &err);
            ck_assert_msg(rc == 0, "calibrate: %d %s", rc, err.message);
            ck_assert_int_eq(hapi_model_calibrate(m, samples, 8, 0, -1, &err), HAPI_EINVAL);
            free(samples);
            hapi_stage_info info;
            ck_assert_int_eq(hapi_model_stage(m, 1, &info), 0);
            ck_assert_int_eq(info.precision, HAPI_PRECISION_INT8);
        } else {
            ck_assert_int_eq(hapi_model_calibrate(m, in, 1, 0, -1, &err), HAPI_EINVAL);
        }
        float *whole = run_fp32(m, to, in, 2);
        size_t n = 2 * stage_elements(m, to);
        /* [0, to) from the image itself */
        float *same = run_range_fp32(m, 0, to, in, HAPI_DTYPE_FP32, 2);
        ck_assert_msg(max_rel_diff(same, whole, n) <= 1e-6, "[0, %d) differs", to);
        free(same);
        for (int s = 1; s < to; s++) {
            size_t fn = 2 * stage_elements(m, s);
            float *feat = run_fp32(m, s, in, 2);
            float *rest = run_range_fp32(m, s, to, feat, HAPI_DTYPE_FP32, 2);
            double cos = cosine(rest, whole, n);
            if (bf16) /* each run rounds to bf16 where the stages meet, as one run does */
                ck_assert_msg(cos >= 0.9999, "bf16 [%d, %d): cosine %.7f", s, to, cos);
            else if (int8) /* quantized again at s with the scale it was dequantized with */
                ck_assert_msg(max_rel_diff(rest, whole, n) <= 1e-5,
                              "int8 [%d, %d) differs: %g", s, to, max_rel_diff(rest, whole, n));
            else
                ck_assert_msg(max_rel_diff(rest, whole, n) <= 1e-5, "fp32 [%d, %d) differs", s,
                              to);
            uint16_t *half = malloc(fn * sizeof(uint16_t));
            ck_assert_ptr_nonnull(half);
            ck_assert_int_eq(hapi_model_run(m, s, in, 2, HAPI_DTYPE_FP16, half, fn * 2, &err), 0);
            float *from_half = run_range_fp32(m, s, to, half, HAPI_DTYPE_FP16, 2);
            double hcos = cosine(from_half, whole, n);
            /* int8: a value fp16 moves across a step boundary quantizes a step away */
            ck_assert_msg(hcos >= (int8 ? 0.999 : 0.9999), "fp16 feature [%d, %d): cosine %.7f",
                          s, to, hcos);
            if (getenv("HAPI_TEST_VERBOSE"))
                fprintf(stderr, "%s %s [%d, %d): cosine %.9f, from fp16 %.9f\n",
                        models[k].path == vit_path ? "vit" : "r18",
                        hapi_precision_name(models[k].precision), s, to, cos, hcos);
            free(from_half);
            free(half);
            free(rest);
            free(feat);
        }
        /* ranges and dtypes out of bounds are refused */
        float out[2 * 512 * 4];
        ck_assert_int_eq(hapi_model_run_range(m, -1, to, in, HAPI_DTYPE_FP32, 1, HAPI_DTYPE_FP32,
                                              out, sizeof(out), &err), HAPI_EINVAL);
        ck_assert_int_eq(hapi_model_run_range(m, 2, 2, in, HAPI_DTYPE_FP32, 1, HAPI_DTYPE_FP32,
                                              out, sizeof(out), &err), HAPI_EINVAL);
        ck_assert_int_eq(hapi_model_run_range(m, 0, hapi_model_num_stages(m) + 1, in,
                                              HAPI_DTYPE_FP32, 1, HAPI_DTYPE_FP32, out,
                                              sizeof(out), &err), HAPI_EINVAL);
        ck_assert_int_eq(hapi_model_run_range(m, 1, to, in, 9, 1, HAPI_DTYPE_FP32, out,
                                              sizeof(out), &err), HAPI_EINVAL);
        free(whole);
        free(in);
        hapi_model_free(m);
    }
}
END_TEST

struct thread_job {
    hapi_model *model;
    const float *input;
    const float *expected;
    size_t n;
    int failures;
};

static void *run_many(void *arg)
{
    struct thread_job *job = arg;
    float *out = malloc(job->n * sizeof(float));
    hapi_error err;
    for (int i = 0; i < 5 && out; i++) {
        if (hapi_model_run(job->model, 6, job->input, 1, HAPI_DTYPE_FP32, out,
                           job->n * sizeof(float), &err) != 0 ||
            max_rel_diff(out, job->expected, job->n) > 1e-5)
            job->failures++;
    }
    if (!out)
        job->failures++;
    free(out);
    return NULL;
}

START_TEST(test_concurrent_runs)
{
    enum { THREADS = 4 };
    hapi_model *m = load_probed(r18_path, 64, 1);
    float *in = det_input(THREADS * R18_INPUT);
    pthread_t tid[THREADS];
    struct thread_job jobs[THREADS];
    size_t n = stage_elements(m, 6);

    for (int t = 0; t < THREADS; t++) {
        jobs[t] = (struct thread_job){m, in + (size_t)t * R18_INPUT, NULL, n, 0};
        jobs[t].expected = run_fp32(m, 6, jobs[t].input, 1);
    }
    for (int t = 0; t < THREADS; t++)
        ck_assert_int_eq(pthread_create(&tid[t], NULL, run_many, &jobs[t]), 0);
    for (int t = 0; t < THREADS; t++) {
        pthread_join(tid[t], NULL);
        ck_assert_int_eq(jobs[t].failures, 0);
        free((void *)jobs[t].expected);
    }
    free(in);
    hapi_model_free(m);
}
END_TEST

START_TEST(test_run_errors)
{
    hapi_error err = {0};
    hapi_model *m = load(r18_path, 0);
    float *in = det_input(R18_INPUT);
    float out[1000];

    /* Before the probe, the input shape is unknown. */
    ck_assert_int_eq(hapi_model_run(m, 7, in, 1, HAPI_DTYPE_FP32, out, sizeof(out), &err),
                     HAPI_EINVAL);
    ck_assert_int_eq(hapi_model_probe(m, 3, 64, 64, &err), 0);
    ck_assert_int_eq(hapi_model_run(m, 7, in, 1, HAPI_DTYPE_FP32, out, sizeof(out), &err), 0);
    err.code = 0;
    ck_assert_int_eq(hapi_model_run(m, 0, in, 1, HAPI_DTYPE_FP32, out, sizeof(out), &err),
                     HAPI_EINVAL);
    ck_assert_int_eq(err.code, HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "1..7"));
    ck_assert_int_eq(hapi_model_run(m, 8, in, 1, HAPI_DTYPE_FP32, out, sizeof(out), &err),
                     HAPI_EINVAL);
    ck_assert_int_eq(hapi_model_run(m, 7, in, 0, HAPI_DTYPE_FP32, out, sizeof(out), &err),
                     HAPI_EINVAL);
    ck_assert_int_eq(hapi_model_run(m, 7, in, 1, 7, out, sizeof(out), &err), HAPI_EINVAL);
    ck_assert_int_eq(hapi_model_run(m, 7, in, 1, HAPI_DTYPE_FP32, out, sizeof(out) - 1, &err),
                     HAPI_EINVAL);
    /* A probe of a shape the stages cannot take fails and names the stage. */
    ck_assert_int_eq(hapi_model_probe(m, 5, 64, 64, &err), HAPI_EMODEL);
    ck_assert_msg(strstr(err.message, "stem") != NULL, "message: %s", err.message);
    ck_assert_ptr_null(strchr(err.message, '\n'));
    free(in);
    hapi_model_free(m);
}
END_TEST

static void check_load_fails(const char *path, int code, const char *needle)
{
    hapi_error err = {0};
    hapi_model *m = (hapi_model *)&err; /* must come back NULL */
    hapi_model_options opt = {0};
    int rc = hapi_model_load(path, &opt, &m, &err);
    ck_assert_msg(rc == code, "%s: got %d (%s), want %d", path, rc, err.message, code);
    ck_assert_int_eq(err.code, code);
    ck_assert_ptr_null(m);
    ck_assert_msg(strstr(err.message, needle) != NULL, "message '%s' lacks '%s'", err.message,
                  needle);
    ck_assert_ptr_null(strchr(err.message, '\n'));
}

START_TEST(test_load_errors)
{
    char missing[PATH_MAX];
    snprintf(missing, sizeof(missing), "%s/missing.pt", tmpdir);
    check_load_fails(missing, -ENOENT, "missing.pt");
    check_load_fails(tmpdir, -EISDIR, "directory");
    check_load_fails(text_path, HAPI_ENOTSTAGED, "not a TorchScript archive");
    check_load_fails(plain_path, HAPI_ENOTSTAGED, "hapifs.json");
    hapi_model_free(NULL);
}
END_TEST

START_TEST(test_load_bad_device)
{
    hapi_error err = {0};
    hapi_model *m = NULL;
    hapi_model_options opt = {.device = "tpu"};
    ck_assert_int_eq(hapi_model_load(r18_path, &opt, &m, &err), HAPI_EINVAL);
    ck_assert_ptr_null(m);
    ck_assert_ptr_nonnull(strstr(err.message, "tpu"));
}
END_TEST

/* --------------------------------------------------------------- extractor */

static int open_ex(const char *path, const char *split, const char *freeze, int dtype,
                   hapi_extractor **ex, hapi_error *err)
{
    hapi_extractor_config cfg = {
        .model_path = path, .split = split, .freeze = freeze, .dtype = dtype,
        .mode = HAPI_PREPROCESS_EXACT, .threads = 2,
    };
    return hapi_extractor_open(&cfg, ex, err);
}

START_TEST(test_extractor_split_words)
{
    static const struct {
        const char *split, *freeze;
        int want_split, want_freeze;
    } cases[] = {
        {"auto", NULL, 6, 6}, {"layer2", "", 3, 6}, {"stem", "layer3", 1, 4}, {"fc", "7", 7, 7},
    };
    static const struct {
        const char *word;
        int want;
    } words[] = {
        {"1", 1}, {"7", 7}, {"stem", 1}, {"layer4", 5}, {"pool", 6}, {"fc", 7},
        {"0", HAPI_EINVAL}, {"8", HAPI_EINVAL}, {"3x", HAPI_EINVAL}, {"-1", HAPI_EINVAL},
        {"", HAPI_EINVAL}, {"99999999999999999999", HAPI_EINVAL}, {"Layer1", HAPI_EINVAL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        hapi_error err = {0};
        hapi_extractor *ex = NULL;
        int rc = open_ex(r18_path, cases[i].split, cases[i].freeze, HAPI_DTYPE_FP32, &ex, &err);
        ck_assert_msg(rc == 0, "split %s: %d %s", cases[i].split, rc, err.message);
        ck_assert_int_eq(hapi_extractor_split(ex), cases[i].want_split);
        ck_assert_int_eq(hapi_extractor_freeze(ex), cases[i].want_freeze);
        ck_assert_str_eq(hapi_extractor_output(ex)->name, r18_stages[cases[i].want_split - 1].name);
        if (i == 0) {
            for (size_t w = 0; w < sizeof(words) / sizeof(words[0]); w++)
                ck_assert_msg(hapi_extractor_parse_split(ex, words[w].word, &err) == words[w].want,
                              "word '%s'", words[w].word);
            ck_assert_int_eq(hapi_extractor_parse_split(ex, "layer9", &err), HAPI_EINVAL);
            ck_assert_ptr_nonnull(strstr(err.message, "layer9"));
            ck_assert_ptr_nonnull(strstr(err.message, "1..7"));
            ck_assert_ptr_nonnull(strstr(err.message, "stem, layer1"));
        }
        hapi_extractor_close(ex);
    }
}
END_TEST

START_TEST(test_extractor_meta_and_sizes)
{
    hapi_error err = {0};
    hapi_extractor *ex = NULL;

    ck_assert_int_eq(open_ex(r18_path, "layer2", NULL, HAPI_DTYPE_FP32, &ex, &err), 0);
    const hapi_model_meta *meta = hapi_extractor_meta(ex);
    ck_assert_str_eq(meta->arch, "resnet18");
    ck_assert_int_eq(meta->input_size, 64);
    ck_assert_int_eq(meta->resize_size, 73);
    ck_assert_int_eq(meta->freeze, 6);
    ck_assert_float_eq_tol(meta->mean[0], 0.485f, 1e-7f);
    ck_assert_float_eq_tol(meta->std[2], 0.225f, 1e-7f);
    const hapi_preprocess *pp = hapi_extractor_preprocess(ex);
    ck_assert_int_eq(pp->resize, 73);
    ck_assert_int_eq(pp->crop, 64);
    ck_assert_float_eq(pp->mean[1], meta->mean[1]);
    ck_assert_float_eq(pp->std[1], meta->std[1]);
    ck_assert_int_eq(hapi_extractor_sample_bytes(ex), 128 * 8 * 8 * 4);
    ck_assert_int_eq(hapi_extractor_dtype(ex), HAPI_DTYPE_FP32);
    ck_assert_ptr_nonnull(hapi_extractor_model(ex));
    hapi_extractor_close(ex);

    ck_assert_int_eq(open_ex(r18_path, "pool", NULL, HAPI_DTYPE_FP16, &ex, &err), 0);
    ck_assert_int_eq(hapi_extractor_sample_bytes(ex), 512 * 2);
    ck_assert_int_eq(hapi_extractor_output(ex)->ndim, 1);
    hapi_extractor_close(ex);
    hapi_extractor_close(NULL);
}
END_TEST

START_TEST(test_extractor_split_errors)
{
    hapi_error err = {0};
    hapi_extractor *ex = (hapi_extractor *)&err;

    ck_assert_int_eq(open_ex(r18_path, "fc", NULL, HAPI_DTYPE_FP32, &ex, &err), HAPI_EINVAL);
    ck_assert_ptr_null(ex);
    ck_assert_ptr_nonnull(strstr(err.message, "freeze 6"));
    ck_assert_ptr_nonnull(strstr(err.message, "1..6"));
    ck_assert_ptr_nonnull(strstr(err.message, "pool"));

    ck_assert_int_eq(open_ex(r18_path, "layer4", "layer3", HAPI_DTYPE_FP32, &ex, &err),
                     HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "freeze 4"));
    ck_assert_int_eq(open_ex(r18_path, "layer9", NULL, HAPI_DTYPE_FP32, &ex, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "split 'layer9'"));
    ck_assert_int_eq(open_ex(r18_path, "3", "nine", HAPI_DTYPE_FP32, &ex, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "freeze 'nine'"));
    ck_assert_int_eq(open_ex(r18_path, "3", NULL, 5, &ex, &err), HAPI_EINVAL);
    ck_assert_ptr_null(ex);
}
END_TEST

START_TEST(test_extractor_not_staged)
{
    hapi_error err = {0};
    hapi_extractor *ex = NULL;
    char missing[PATH_MAX];

    snprintf(missing, sizeof(missing), "%s/missing.pt", tmpdir);
    ck_assert_int_eq(open_ex(missing, "auto", NULL, HAPI_DTYPE_FP32, &ex, &err), -ENOENT);
    ck_assert_int_eq(open_ex(text_path, "auto", NULL, HAPI_DTYPE_FP32, &ex, &err),
                     HAPI_ENOTSTAGED);
    ck_assert_int_eq(open_ex(plain_path, "auto", NULL, HAPI_DTYPE_FP32, &ex, &err),
                     HAPI_ENOTSTAGED);
    ck_assert_int_eq(open_ex(badmeta_path, "auto", NULL, HAPI_DTYPE_FP32, &ex, &err),
                     HAPI_ENOTSTAGED);
    ck_assert_ptr_nonnull(strstr(err.message, "\"arch\""));
    ck_assert_ptr_null(ex);
}
END_TEST

/* Opens DIR/tiny-NAME.pt (see python_tiny); returns what hapi_extractor_open() does. */
static int open_tiny(const char *name, hapi_extractor **ex, hapi_error *err)
{
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/tiny-%s.pt", tmpdir, name);
    return open_ex(path, "auto", NULL, HAPI_DTYPE_FP32, ex, err);
}

/* Version 2 names the interpolation, which reaches the preprocessing; version 1 is bilinear. */
START_TEST(test_extractor_meta_interpolation)
{
    static const struct {
        const char *name;
        int version, interpolation;
        const char *weights, *weights_enum;
    } cases[] = {
        {"bicubic", 2, HAPI_INTERP_BICUBIC, "random:seed=7",
         "EfficientNet_B0_Weights.IMAGENET1K_V1"},
        {"bilinear", 2, HAPI_INTERP_BILINEAR, "file:my weights.pth", ""},
        {"v1", 1, HAPI_INTERP_BILINEAR, "", ""},
        {"v1-says-bilinear", 1, HAPI_INTERP_BILINEAR, "", ""},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        hapi_error err = {0};
        hapi_extractor *ex = NULL;
        int rc = open_tiny(cases[i].name, &ex, &err);
        ck_assert_msg(rc == 0, "%s: %d %s", cases[i].name, rc, err.message);
        const hapi_model_meta *meta = hapi_extractor_meta(ex);
        ck_assert_int_eq(meta->version, cases[i].version);
        ck_assert_int_eq(meta->interpolation, cases[i].interpolation);
        ck_assert_int_eq(hapi_extractor_preprocess(ex)->interpolation, cases[i].interpolation);
        ck_assert_int_eq(hapi_extractor_preprocess(ex)->resize, 18);
        ck_assert_str_eq(meta->weights, cases[i].weights);
        ck_assert_str_eq(meta->weights_enum, cases[i].weights_enum);
        hapi_extractor_close(ex);
    }
    /* The exporter records its random weights, whatever version it writes. */
    hapi_error err = {0};
    hapi_extractor *ex = NULL;
    ck_assert_int_eq(open_ex(r18_path, "auto", NULL, HAPI_DTYPE_FP32, &ex, &err), 0);
    ck_assert_str_eq(hapi_extractor_meta(ex)->weights, "random:seed=0");
    hapi_extractor_close(ex);
}
END_TEST

/* An unknown version or interpolation refuses the archive with one line that names it. */
START_TEST(test_extractor_meta_refused)
{
    static const struct {
        const char *name, *says;
    } cases[] = {
        {"lanczos", "\"interpolation\" \"lanczos\" is unknown (bilinear or bicubic)"},
        {"no-interpolation", "\"interpolation\" is missing"},
        {"interpolation-number", "\"interpolation\" is not a string"},
        {"v1-bicubic", "version 1 resizes bilinearly; \"interpolation\" \"bicubic\" needs version 2"},
        {"v3", "version 3, this hapifs reads versions 1..2"},
        {"v0", "version 0, this hapifs reads versions 1..2"},
        {"weights-number", "\"weights\" is invalid"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        hapi_error err = {0};
        hapi_extractor *ex = (hapi_extractor *)&err;
        ck_assert_int_eq(open_tiny(cases[i].name, &ex, &err), HAPI_ENOTSTAGED);
        ck_assert_ptr_null(ex);
        ck_assert_msg(strstr(err.message, cases[i].says), "%s: %s", cases[i].name, err.message);
        ck_assert_ptr_null(strchr(err.message, '\n'));
    }
}
END_TEST

START_TEST(test_extractor_digest)
{
    hapi_error err = {0};
    hapi_extractor *a = NULL, *b = NULL, *c = NULL;
    static const uint8_t zero[16];

    ck_assert_int_eq(open_ex(r18_path, "auto", NULL, HAPI_DTYPE_FP32, &a, &err), 0);
    ck_assert_int_eq(open_ex(r18_copy_path, "3", NULL, HAPI_DTYPE_FP16, &b, &err), 0);
    ck_assert_int_eq(open_ex(r18_other_path, "auto", NULL, HAPI_DTYPE_FP32, &c, &err), 0);
    /* The digest is of the file's bytes only: same bytes, same digest, whatever the split;
     * the same weights with other metadata are another file. */
    ck_assert_mem_ne(hapi_extractor_model_digest(a), zero, 16);
    ck_assert_mem_eq(hapi_extractor_model_digest(a), hapi_extractor_model_digest(b), 16);
    ck_assert_mem_ne(hapi_extractor_model_digest(a), hapi_extractor_model_digest(c), 16);
    hapi_extractor_close(a);
    hapi_extractor_close(b);
    hapi_extractor_close(c);
}
END_TEST

/*
 * A block as big as a batch's activations at full size (48 MiB, above glibc's largest mmap
 * threshold), written, freed and taken again: the minor page faults of taking and writing it.
 */
static long refault_pages(void)
{
    const size_t size = 48u << 20;
    volatile char *p = malloc(size);
    ck_assert_ptr_nonnull((void *)p);
    for (size_t i = 0; i < size; i += 4096)
        p[i] = 1;
    free((void *)p);
    struct rusage before, after;
    getrusage(RUSAGE_SELF, &before); /* malloc itself writes the block under MALLOC_PERTURB_ */
    p = malloc(size);
    ck_assert_ptr_nonnull((void *)p);
    for (size_t i = 0; i < size; i += 4096)
        p[i] = 2;
    getrusage(RUSAGE_SELF, &after);
    free((void *)p);
    return after.ru_minflt - before.ru_minflt;
}

/* Without hapi_extractor_keep_heap() the second batch faults its memory in again; with it, not. */
START_TEST(test_keep_heap_reuses_memory)
{
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) { /* glibc's defaults, in a process of its own */
        long n = refault_pages();
        _exit(write(fds[1], &n, sizeof(n)) == (ssize_t)sizeof(n) ? 0 : 1);
    }
    long plain = 0;
    ck_assert_int_eq(read(fds[0], &plain, sizeof(plain)), (ssize_t)sizeof(plain));
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    close(fds[0]);
    close(fds[1]);
    hapi_extractor_keep_heap(1u << 30);
    long kept = refault_pages();
    ck_assert_msg(plain >= 10000, "glibc's defaults refaulted only %ld pages of 12288", plain);
    ck_assert_msg(kept < 100, "with the heap kept, %ld pages were faulted in again", kept);
}
END_TEST

/* ------------------------------------------------------------------- setup */

/* Headers byte-for-byte as numpy parses them: checked against numpy in the mount tests too. */
START_TEST(test_npy_header)
{
    char buf[HAPI_NPY_HEADER_MAX];
    int64_t one[] = { 512 };
    int len = hapi_npy_header(buf, HAPI_DTYPE_FP16, one, 1);
    ck_assert_int_eq(len % 64, 0);
    ck_assert_int_eq(memcmp(buf, "\x93NUMPY\x01\x00", 8), 0);
    ck_assert_int_eq((unsigned char)buf[8] | (unsigned char)buf[9] << 8, len - 10);
    ck_assert_int_eq(buf[len - 1], '\n');
    ck_assert_ptr_nonnull(strstr(buf + 10, "{'descr': '<f2', 'fortran_order': False, 'shape': (512,), }"));

    int64_t three[] = { 256, 4, 4 };
    len = hapi_npy_header(buf, HAPI_DTYPE_FP32, three, 3);
    ck_assert_int_eq(len % 64, 0);
    ck_assert_ptr_nonnull(strstr(buf + 10, "'descr': '<f4'"));
    ck_assert_ptr_nonnull(strstr(buf + 10, "'shape': (256, 4, 4), }"));

    len = hapi_npy_header(buf, HAPI_DTYPE_FP32, NULL, 0);
    ck_assert_ptr_nonnull(strstr(buf + 10, "'shape': (), }"));

    ck_assert_int_eq(hapi_npy_header(buf, 7, one, 1), HAPI_EINVAL);
    int64_t neg[] = { -1 };
    ck_assert_int_eq(hapi_npy_header(buf, HAPI_DTYPE_FP32, neg, 1), HAPI_EINVAL);
}
END_TEST

/* What hapi_npy_header() writes parses back; a part of it asks for more; anything else is refused. */
START_TEST(test_npy_parse)
{
    char buf[HAPI_NPY_HEADER_MAX];
    int64_t shapes[3][3] = { { 512 }, { 256, 4, 4 }, { 0 } }, shape[HAPI_MAX_DIMS];
    int ndims[3] = { 1, 3, 0 }, dtype, ndim;
    for (int i = 0; i < 3; i++) {
        int t = i == 0 ? HAPI_DTYPE_FP16 : HAPI_DTYPE_FP32;
        int len = hapi_npy_header(buf, t, shapes[i], ndims[i]);
        ck_assert_int_eq(hapi_npy_parse(buf, (size_t)len, &dtype, shape, &ndim), len);
        ck_assert_int_eq(dtype, t);
        ck_assert_int_eq(ndim, ndims[i]);
        for (int d = 0; d < ndim; d++)
            ck_assert_int_eq(shape[d], shapes[i][d]);
        for (size_t part = 0; part < (size_t)len; part += 7)
            ck_assert_int_eq(hapi_npy_parse(buf, part, &dtype, shape, &ndim), -EAGAIN);
    }
    int len = hapi_npy_header(buf, HAPI_DTYPE_FP32, shapes[1], 3);
    char bad[HAPI_NPY_HEADER_MAX];
    const char *edits[][2] = { { "<f4", "<i4" }, { "False", "True " }, { "4, 4", "4,x4" },
                               { "NUMPY", "NUMPZ" }, { "), }", ")  }" } };
    for (size_t i = 0; i < sizeof(edits) / sizeof(edits[0]); i++) {
        memcpy(bad, buf, (size_t)len);
        char *at = memmem(bad, (size_t)len, edits[i][0], strlen(edits[i][0]));
        ck_assert_ptr_nonnull(at);
        memcpy(at, edits[i][1], strlen(edits[i][1]));
        ck_assert_int_eq(hapi_npy_parse(bad, (size_t)len, &dtype, shape, &ndim), HAPI_EINVAL);
    }
    memcpy(bad, buf, (size_t)len);
    bad[len - 1] = ' ';
    ck_assert_int_eq(hapi_npy_parse(bad, (size_t)len, &dtype, shape, &ndim), HAPI_EINVAL);
    ck_assert_int_eq(hapi_npy_parse("", 0, &dtype, shape, &ndim), -EAGAIN);
}
END_TEST

static void remove_fixtures(void);

static void make_fixtures(void)
{
    char root[PATH_MAX], exporter[PATH_MAX + 32];
    source_root(root, sizeof(root));
    snprintf(exporter, sizeof(exporter), "%s/tools/hapifs-export-model", root);
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        exit(1);
    }
    snprintf(r18_path, sizeof(r18_path), "%s/r18.pt", tmpdir);
    snprintf(r18_copy_path, sizeof(r18_copy_path), "%s/r18-copy.pt", tmpdir);
    snprintf(r18_other_path, sizeof(r18_other_path), "%s/r18-other.pt", tmpdir);
    snprintf(vit_path, sizeof(vit_path), "%s/vit.pt", tmpdir);
    snprintf(plain_path, sizeof(plain_path), "%s/plain.pt", tmpdir);
    snprintf(badmeta_path, sizeof(badmeta_path), "%s/badmeta.pt", tmpdir);
    snprintf(text_path, sizeof(text_path), "%s/text.pt", tmpdir);

    char *export_r18[] = {PYTHON, exporter, "resnet18", "-o", r18_path, "--input-size", "64",
                          "-q", NULL};
    char *export_vit[] = {PYTHON, exporter, "vit_b_16", "-o", vit_path, "--input-size", "32",
                          "-q", NULL};
    char *copy[] = {"/bin/cp", r18_path, r18_copy_path, NULL};
    char *script = malloc(sizeof(python_tiny) + sizeof(python_fixtures));
    if (!script) {
        perror("test-model");
        exit(1);
    }
    strcat(strcpy(script, python_tiny), python_fixtures);
    char *fixtures[] = {PYTHON, "-c", script, tmpdir, r18_path, vit_path, NULL};
    int failed = run(export_r18) != 0 || run(export_vit) != 0 || run(copy) != 0 ||
                 run(fixtures) != 0;
    free(script);
    if (failed) {
        fprintf(stderr, "test-model: could not make the fixtures with %s\n", exporter);
        remove_fixtures();
        exit(1);
    }
    FILE *f = fopen(text_path, "w");
    if (!f || fputs("this is not a model\n", f) < 0 || fclose(f) != 0) {
        perror(text_path);
        remove_fixtures();
        exit(1);
    }
}

static void remove_fixtures(void)
{
    char *rm[] = {"/bin/rm", "-rf", tmpdir, NULL};
    run(rm);
}

static Suite *model_suite(void)
{
    Suite *s = suite_create("model");
    struct {
        const char *name;
        const TTest *test;
    } cases[] = {
        {"stage names and shapes", test_stage_names_and_shapes},
        {"vit shapes", test_vit_shapes},
        {"batch equals singles", test_batch_equals_singles},
        {"fp16 is rounded fp32", test_fp16_is_rounded_fp32},
        {"parity resnet", test_parity_resnet},
        {"parity vit", test_parity_vit},
        {"bf16 close to reference", test_bf16_close_to_reference},
        {"run range finishes a split", test_run_range_finishes_a_split},
        {"concurrent runs", test_concurrent_runs},
        {"run errors", test_run_errors},
        {"load errors", test_load_errors},
        {"load bad device", test_load_bad_device},
        {"extractor split words", test_extractor_split_words},
        {"extractor meta and sizes", test_extractor_meta_and_sizes},
        {"extractor split errors", test_extractor_split_errors},
        {"extractor not staged", test_extractor_not_staged},
        {"extractor meta interpolation", test_extractor_meta_interpolation},
        {"extractor meta refused", test_extractor_meta_refused},
        {"extractor digest", test_extractor_digest},
        {"npy header", test_npy_header},
        {"npy parse", test_npy_parse},
#ifndef __SANITIZE_ADDRESS__ /* ASan has its own allocator: mallopt() does not reach it */
        {"keep heap reuses memory", test_keep_heap_reuses_memory},
#endif
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_set_timeout(tc, 120); /* libtorch's first runs of an optimized graph are slow */
        tcase_add_test(tc, cases[i].test);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void)
{
    make_fixtures();
    SRunner *sr = srunner_create(model_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    remove_fixtures();
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
