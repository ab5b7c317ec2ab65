/*
 * model-time — times each stage of a staged model as a hapifs daemon runs it
 * (the extractor's load: frozen, optimize_for_inference, its thread count),
 * at the batch sizes given, and prints JSON: the BLAS in use, and per stage
 * the median milliseconds per image of each batch. bench/bench-blas runs it
 * once per BLAS (LD_LIBRARY_PATH picks the libblas.so.3). Not installed.
 *
 *   model-time MODEL [--batches 1,8] [--reps 3] [--warmups 2] [--threads N] [--bf16|--int8]
 *
 * --int8 calibrates on seeded image-like samples (a mount calibrates on its own images).
 */
#include "extractor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_BATCHES 8
#define MAX_REPS 64

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int usage(void)
{
    fprintf(stderr, "usage: model-time MODEL [--batches 1,8] [--reps 3] [--warmups 2] "
                    "[--threads N] [--bf16|--int8]\n");
    return 2;
}

int main(int argc, char **argv)
{
    const char *model = NULL;
    int batches[MAX_BATCHES] = { 1, 8 }, nbatches = 2, reps = 3, warmups = 2;
    int precision = HAPI_PRECISION_FP32;
    int threads = (int)sysconf(_SC_NPROCESSORS_ONLN); /* the daemon's default torch_threads */

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--batches") == 0 && i + 1 < argc) {
            char *s = argv[++i], *end;
            nbatches = 0;
            while (*s && nbatches < MAX_BATCHES) {
                long b = strtol(s, &end, 10);
                if (end == s || b < 1 || b > 4096)
                    return usage();
                batches[nbatches++] = (int)b;
                s = *end == ',' ? end + 1 : end;
                if (*end && *end != ',')
                    return usage();
            }
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            reps = atoi(argv[++i]);
            if (reps < 1 || reps > MAX_REPS)
                return usage();
        } else if (strcmp(argv[i], "--warmups") == 0 && i + 1 < argc) {
            warmups = atoi(argv[++i]);
            if (warmups < 0 || warmups > MAX_REPS)
                return usage();
        } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = atoi(argv[++i]);
            if (threads < 1)
                return usage();
        } else if (strcmp(argv[i], "--bf16") == 0) {
            precision = HAPI_PRECISION_BF16;
        } else if (strcmp(argv[i], "--int8") == 0) {
            precision = HAPI_PRECISION_INT8;
        } else if (argv[i][0] != '-' && !model) {
            model = argv[i];
        } else {
            return usage();
        }
    }
    if (!model)
        return usage();

    hapi_extractor_config cfg = {
        .model_path = model, .dtype = HAPI_DTYPE_FP32, .mode = HAPI_PREPROCESS_EXACT,
        .threads = threads, .precision = precision,
    };
    hapi_extractor_keep_heap(1ull << 30); /* as the daemon runs at its default mem= */
    hapi_extractor *ex = NULL;
    hapi_error err = { 0 };
    if (hapi_extractor_open(&cfg, &ex, &err) < 0) {
        fprintf(stderr, "model-time: %s\n", err.message);
        return 1;
    }
    hapi_model *m = hapi_extractor_model(ex);
    int n = hapi_model_num_stages(m);
    uint64_t *one = calloc((size_t)n, sizeof(*one));
    uint64_t *ns = calloc((size_t)n * (size_t)reps, sizeof(*ns));
    double *ms = calloc((size_t)n * MAX_BATCHES, sizeof(*ms));
    if (!one || !ns || !ms) {
        fprintf(stderr, "model-time: out of memory\n");
        return 1;
    }
    for (int k = 0; k < nbatches; k++) {
        /* TorchScript's executor specialises on the first runs of a shape */
        for (int w = 0; w < warmups; w++)
            if (hapi_model_measure(m, batches[k], NULL, NULL, one, &err) < 0)
                goto fail;
        for (int r = 0; r < reps; r++) {
            if (hapi_model_measure(m, batches[k], NULL, NULL, one, &err) < 0)
                goto fail;
            for (int i = 0; i < n; i++)
                ns[(size_t)i * (size_t)reps + (size_t)r] = one[i];
        }
        for (int i = 0; i < n; i++) {
            uint64_t *v = ns + (size_t)i * (size_t)reps;
            qsort(v, (size_t)reps, sizeof(*v), cmp_u64);
            ms[(size_t)i * MAX_BATCHES + (size_t)k] = (double)v[reps / 2] / 1e6 / batches[k];
        }
    }

    printf("{\"blas\": \"%s\", \"threads\": %d, \"precision\": \"%s\", \"reps\": %d, "
           "\"batches\": [", hapi_model_blas(), threads, hapi_precision_name(precision), reps);
    for (int k = 0; k < nbatches; k++)
        printf("%s%d", k ? ", " : "", batches[k]);
    printf("], \"stages\": [");
    for (int i = 0; i < n; i++) {
        hapi_stage_info info;
        hapi_model_stage(m, i, &info);
        printf("%s\n  {\"name\": \"%s\", \"precision\": \"%s\", \"check_cosine\": %.6f, "
               "\"ms_per_image\": [", i ? "," : "", info.name, hapi_precision_name(info.precision),
               info.check_cosine);
        for (int k = 0; k < nbatches; k++)
            printf("%s%.3f", k ? ", " : "", ms[(size_t)i * MAX_BATCHES + (size_t)k]);
        printf("]}");
    }
    printf("]}\n");
    free(one);
    free(ns);
    free(ms);
    hapi_extractor_close(ex);
    return 0;
fail:
    fprintf(stderr, "model-time: %s\n", err.message);
    hapi_extractor_close(ex);
    return 1;
}
