/*
 * policy-eval — the policy's choice replayed off-line: a stored profile and the inputs a mount's
 * policy had (`hapifs-ctl --json policy`, or the "inputs" a bench/bench-policy --grid cell keeps)
 * through this build's hapi_policy_choose(), printed as `hapifs-ctl policy` prints it. With
 * NAME=VALUE an input changed first (rtt_ms=1, client_speed=4, storage_file_ms=0.25): what the
 * policy would pick then. bench/bench-policy --replay scores a grid's measured cells with it
 * after the model changes, without measuring them again. Not installed.
 *
 *   policy-eval PROFILE.json POLICY.json [NAME=VALUE ...]
 */
#include "policy.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(void)
{
    fprintf(stderr, "usage: policy-eval PROFILE.json POLICY.json [NAME=VALUE ...]\n");
    return 2;
}

/* Sets inputs[NAME] to VALUE: a number when it reads as one, else a string. */
static int override(json_t *inputs, const char *arg)
{
    const char *eq = strchr(arg, '=');
    if (!eq || eq == arg || (size_t)(eq - arg) >= 128) {
        fprintf(stderr, "policy-eval: %s: expected NAME=VALUE\n", arg);
        return -1;
    }
    char name[128];
    memcpy(name, arg, (size_t)(eq - arg));
    name[eq - arg] = '\0';
    /* inputs a file kept before they existed may lack (hapi_policy_input_from_json reads
       them as "no bound") */
    static const char *const later[] = { "link_bytes" };
    int known = json_object_get(inputs, name) != NULL;
    for (size_t i = 0; i < sizeof(later) / sizeof(*later); i++)
        known |= strcmp(name, later[i]) == 0;
    if (!known) {
        fprintf(stderr, "policy-eval: %s: the inputs have no \"%s\"\n", arg, name);
        return -1;
    }
    char *end;
    double v = strtod(eq + 1, &end);
    json_t *value = *(eq + 1) && !*end ? json_real(v) : json_string(eq + 1);
    return json_object_set_new(inputs, name, value);
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return usage();
    hapi_error err = { 0 };
    hapi_profile *prof = malloc(sizeof(*prof));
    hapi_policy_input *in = malloc(sizeof(*in));
    hapi_policy_choice *c = malloc(sizeof(*c));
    json_error_t je;
    json_t *root = json_load_file(argv[2], 0, &je);
    int rc = 1;
    char *text = NULL, *out = NULL;
    if (!prof || !in || !c) {
        fprintf(stderr, "policy-eval: out of memory\n");
        goto done;
    }
    if (hapi_profile_load(argv[1], prof, &err) < 0) {
        fprintf(stderr, "policy-eval: %s: %s\n", argv[1], err.message);
        goto done;
    }
    if (!root) {
        fprintf(stderr, "policy-eval: %s: %s (line %d)\n", argv[2], je.text, je.line);
        goto done;
    }
    json_t *inputs = json_object_get(root, "inputs") ? json_object_get(root, "inputs") : root;
    for (int i = 3; i < argc; i++)
        if (override(inputs, argv[i]) < 0)
            goto done;
    text = json_dumps(root, 0);
    if (!text || hapi_policy_input_from_json(text, prof, in, &err) < 0 ||
        hapi_policy_choose(in, c, &err) < 0) {
        fprintf(stderr, "policy-eval: %s: %s\n", argv[2], text ? err.message : "out of memory");
        goto done;
    }
    out = hapi_policy_to_json(in, c);
    if (!out) {
        fprintf(stderr, "policy-eval: out of memory\n");
        goto done;
    }
    printf("%s\n", out);
    rc = 0;
done:
    free(out);
    free(text);
    json_decref(root);
    free(c);
    free(in);
    free(prof);
    return rc;
}
