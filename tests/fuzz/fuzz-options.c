/*
 * fuzz-options.c — libFuzzer target: the mount's option parser (the fuse_opt
 * table, then validation) and the value parsers behind it, on -o strings an
 * fstab line or a command line may hold.
 *
 * Input: the -o string. The harness names its own model= and cache= (so that
 * a run never creates directories the fuzzer names, or opens a FIFO as the
 * model) and skips inputs that name them; the first byte's low bit selects
 * the mount helper's command line (mount.hapifs) instead of hapifs's.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hapi.h"
#include "log.h"
#include "options.h"
#include "policy.h"

static char src[256], mnt[256], model[256], cache[256];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    char top[] = "/tmp/hapi-fuzz-options-XXXXXX";
    if (!mkdtemp(top))
        abort();
    snprintf(src, sizeof(src), "%s/src", top);
    snprintf(mnt, sizeof(mnt), "%s/mnt", top);
    snprintf(model, sizeof(model), "%s/model.pt", top);
    snprintf(cache, sizeof(cache), "%s/cache", top);
    FILE *f = NULL;
    if (mkdir(src, 0755) < 0 || mkdir(mnt, 0755) < 0 || mkdir(cache, 0755) < 0 ||
        !(f = fopen(model, "w")))
        abort();
    fclose(f);
    hapi_log_open("/dev/null", 0, 0);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 4096)
        return 0;
    int helper = data[0] & 1;
    char *text = strndup((const char *)data + 1, size - 1);
    if (!text)
        return 0;
    if (strstr(text, "model=") || strstr(text, "cache=") || strstr(text, "log=")) {
        free(text);
        return 0;
    }
    char *opts = NULL;
    if (asprintf(&opts, "model=%s,cache=%s,%s", model, cache, text) < 0)
        abort();
    char *argv[] = { helper ? "mount.hapifs" : "hapifs", src, mnt, "-o", opts, NULL };
    hapi_fs_options o;
    hapi_error err = { 0 };
    int rc = hapi_fs_options_parse(5, argv, helper, &o, &err);
    if (rc < 0 && !err.message[0])
        abort(); /* every refusal says why */
    hapi_fs_options_free(&o);

    /* the value parsers alone, on the whole text */
    uint64_t bytes;
    double value;
    hapi_fs_parse_size(text, &bytes);
    hapi_fs_parse_time(text, &value);
    hapi_policy_parse_rate(text, &value, &err);
    size_t ninputs;
    const hapi_policy_input_spec *inputs = hapi_policy_input_specs(&ninputs);
    for (size_t i = 0; i < ninputs; i++) {
        const hapi_policy_input_spec *s = &inputs[i];
        hapi_policy_input_value in;
        err.message[0] = '\0';
        if (hapi_policy_input_parse(s->name, text, &in, &err) < 0) {
            if (!err.message[0])
                abort(); /* a refusal says why */
            continue;
        }
        int ranged = !in.is_word && s->kind != HAPI_INPUT_ENUM && s->kind != HAPI_INPUT_MS_LIST;
        if (ranged && !(in.number >= s->min && in.number <= s->max))
            abort(); /* a value taken is in range */
    }
    free(opts);
    free(text);
    return 0;
}
