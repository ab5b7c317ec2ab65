/* inputs.c — the policy's inputs an operator gives: one table of their meaning, unit, range and parser, and the parsers. */
#include "policy.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* --------------------------------------------------------------- the table */

/*
 * Mount options (fusefs/options.c), .hapifs/ctl commands (fusefs/ctl.c) and
 * hapifs-ctl's set-* (tools/hapifs-ctl.c) all parse through this table: an
 * input has one range and one message wherever it is given. The limits are
 * what a user could mean; a value past them is a typo or a wrong unit, and
 * the policy's estimates would mean nothing there. Each range's two ends, as
 * written in .range, parse to .min and .max, and each .fallback to the
 * default the policy takes (tests/test-policy.c checks both). hapifs --help
 * prints the mount options' lines from this table (hapi_policy_input_help);
 * README.md, hapifs(8) and hapifs-ctl(1) state the same ranges
 * (tests/test_examples.py compares README's with --help).
 */
static const hapi_policy_input_spec specs[] = {
    { .name = "link", .kind = HAPI_INPUT_RATE, .unit = "bit/s", .mount_option = 1,
      .value = "RATE", .fallback = "1Gbit",
      .meaning = "the link's rate to the compute tier",
      .min = 1e3, .max = 1e13, .range = "1kbit/s..10Tbit/s",
      .why = "below 1 kbit/s one feature file takes minutes to cross; 10 Tbit/s is beyond any "
             "NIC (Ethernet's fastest is 800 Gbit/s): room to say the link costs nothing" },
    { .name = "link_bytes", .kind = HAPI_INPUT_FLOAT, .unit = "times", .mount_option = 1,
      .value = "X", .fallback = "1",
      .meaning = "the most a split's .feat may put on the link, in source images' bytes",
      .min = 0.001, .max = 1000, .range = "0.001..1000", .words = "any",
      .why = "1: never more than the images themselves (HAPI_POLICY_LINK_BYTES_DEFAULT); a "
             "thousandth is below any feature (a ResNet's pooled 4 KB against a 100 KB JPEG is "
             "0.04), and past 1000x any split is within; any: no bound" },
    { .name = "rtt", .kind = HAPI_INPUT_TIME, .unit = "s", .mount_option = 1,
      .value = "TIME", .fallback = "0",
      .meaning = "the link's round-trip time",
      .min = 0, .max = 10, .range = "0..10s",
      .why = "0: bytes alone (one rack); a geostationary satellite hop is 0.6 s, and a network "
             "filesystem whose every request waits 10 s is not one a job reads through" },
    { .name = "transport", .kind = HAPI_INPUT_ENUM, .unit = "", .mount_option = 1,
      .value = "file|pack", .fallback = "file",
      .meaning = "how the compute tier reads: file (one .feat at a time) or pack (-o remote)",
      .words = "file|pack", .range = "file|pack",
      .why = "the transports the policy costs (enum hapi_policy_transport)" },
    { .name = "client_speed", .kind = HAPI_INPUT_FLOAT, .unit = "times", .mount_option = 1,
      .value = "X", .fallback = "1",
      .meaning = "the compute tier's speed relative to this node",
      .min = 0.001, .max = 10000, .range = "0.001..10000",
      .why = "a GPU against one storage core is ~1000x; past 10000x (or below 1/1000) every "
             "stage on one tier costs nothing next to the other's, so larger factors change "
             "no choice and are typos" },
    { .name = "compute_file_ms", .kind = HAPI_INPUT_FLOAT, .unit = "ms", .mount_option = 1,
      .value = "MS", .fallback = "1.5",
      .meaning = "the compute tier's training loop per file beside the stages it runs",
      .min = 0, .max = 1000, .range = "0..1000", .words = "default",
      .why = "measured 1.3-1.8 ms (HAPI_POLICY_COMPUTE_FILE_MS); a second a file is a loop "
             "no feature split speeds up, or ms taken for us" },
    { .name = "epochs", .kind = HAPI_INPUT_INT, .unit = "epochs", .mount_option = 1,
      .value = "N", .fallback = "5",
      .meaning = "epochs a job is expected to read",
      .min = 1, .max = 100000, .range = "1..100000",
      .why = "a job reads at least one; the choice stops changing after a few hundred (later "
             "epochs dominate the total), 100000 leaves room without overflowing a count" },
    { .name = "compute_cache", .kind = HAPI_INPUT_SIZE, .unit = "bytes",
      .value = "SIZE", .fallback = "0",
      .meaning = "bytes of .feat files the compute tier keeps between epochs (its page cache)",
      .min = 0, .max = 1125899906842624.0, .range = "0..1024T",
      .why = "0: nothing kept; a petabyte is more than any compute node's memory: room to say "
             "it keeps everything" },
    { .name = "readers", .kind = HAPI_INPUT_INT, .unit = "readers",
      .value = "N", .fallback = "8",
      .meaning = "concurrent per-file readers on the compute tier",
      .min = 1, .max = 1024, .range = "1..1024",
      .why = "at least one; 1024 is threads='s most FUSE workers: more readers than workers "
             "queue, they are not served at once" },
    { .name = "compute_stages", .kind = HAPI_INPUT_MS_LIST, .unit = "ms",
      .value = "MS,...", .fallback = "none",
      .meaning = "the compute tier's ms per sample of each frozen stage from the first",
      .min = 0, .max = 60000, .range = "0..60000", .words = "none",
      .why = "a minute a sample for one stage is a model nobody trains on that tier; at most "
             "HAPI_PROFILE_MAX_STAGES stages, as a profile" },
};

#define NSPECS (sizeof(specs) / sizeof(*specs))

const hapi_policy_input_spec *hapi_policy_input_specs(size_t *count)
{
    if (count)
        *count = NSPECS;
    return specs;
}

const hapi_policy_input_spec *hapi_policy_input_find(const char *name)
{
    for (size_t i = 0; name && i < NSPECS; i++)
        if (strcmp(specs[i].name, name) == 0)
            return &specs[i];
    return NULL;
}

int hapi_policy_input_help(const hapi_policy_input_spec *s, char *buf, size_t size)
{
    if (s->kind == HAPI_INPUT_ENUM)
        return snprintf(buf, size, "%s (default %s)", s->meaning, s->fallback);
    size_t len = strlen(s->range);
    int unitless = len && isdigit((unsigned char)s->range[len - 1]);
    return snprintf(buf, size, "%s: %s%s%s%s%s (default %s)", s->meaning, s->range,
                    unitless ? " " : "", unitless ? s->unit : "", s->words ? ", or " : "",
                    s->words ? s->words : "", s->fallback);
}

/* -------------------------------------------------------------- the parsers */

/* Why a rate did not parse, for the two messages built from it. */
enum rate_fault { RATE_OK, RATE_NOT_A_NUMBER, RATE_NO_UNIT, RATE_BPS, RATE_UNKNOWN_UNIT };

/* Parses a rate (see hapi_policy_parse_rate); *unit points to the unit given. */
static enum rate_fault parse_rate(const char *text, double *bits_per_s, const char **unit)
{
    static const struct { const char *prefix; double factor; } prefixes[] = {
        { "Ki", 1024.0 }, { "Mi", 1048576.0 }, { "Gi", 1073741824.0 },
        { "Ti", 1099511627776.0 }, { "k", 1e3 }, { "K", 1e3 }, { "M", 1e6 }, { "m", 1e6 },
        { "G", 1e9 }, { "g", 1e9 }, { "T", 1e12 }, { "t", 1e12 }, { "", 1.0 },
    };
    char *end;
    *unit = "";
    if (!text || !*text || isspace((unsigned char)*text))
        return RATE_NOT_A_NUMBER;
    double v = strtod(text, &end);
    if (end == text || !isfinite(v) || v <= 0)
        return RATE_NOT_A_NUMBER;
    while (*end == ' ')
        end++;
    *unit = end;
    if (!*end)
        return RATE_NO_UNIT;
    for (size_t i = 0; i < sizeof(prefixes) / sizeof(*prefixes); i++) {
        size_t n = strlen(prefixes[i].prefix);
        if (strncmp(end, prefixes[i].prefix, n) != 0)
            continue;
        const char *u = end + n;
        if (strcasecmp(u, "bit") == 0 || strcasecmp(u, "bit/s") == 0 ||
            strcasecmp(u, "bits") == 0 || strcasecmp(u, "bits/s") == 0 || strcmp(u, "b/s") == 0) {
            *bits_per_s = v * prefixes[i].factor;
            return RATE_OK;
        }
        if (strcmp(u, "B/s") == 0 || strcmp(u, "B") == 0) {
            *bits_per_s = v * prefixes[i].factor * 8;
            return RATE_OK;
        }
    }
    return strcasestr(end, "bps") ? RATE_BPS : RATE_UNKNOWN_UNIT;
}

int hapi_policy_parse_rate(const char *text, double *bits_per_s, hapi_error *err)
{
    const char *unit;
    switch (parse_rate(text, bits_per_s, &unit)) {
    case RATE_OK:
        return 0;
    case RATE_NOT_A_NUMBER:
        return hapi_error_set(err, HAPI_EINVAL,
                              "link rate '%s': expected a positive number and a unit, "
                              "e.g. 1Gbit or 125MB/s", text ? text : "");
    case RATE_NO_UNIT:
        return hapi_error_set(err, HAPI_EINVAL,
                              "link rate '%s' has no unit: write e.g. %sGbit (bits/s) or "
                              "%sMB/s (bytes/s)", text, text, text);
    case RATE_BPS:
        return hapi_error_set(err, HAPI_EINVAL,
                              "link rate '%s': 'bps' is ambiguous (tc reads it as bytes); "
                              "write Mbit or MB/s", text);
    default:
        return hapi_error_set(err, HAPI_EINVAL,
                              "link rate '%s': unknown unit '%s' (use bit, kbit, Mbit, Gbit, "
                              "or B/s, kB/s, MB/s, GB/s, MiB/s, ...)", text, unit);
    }
}

void hapi_policy_format_rate(double bps, char *buf, size_t size)
{
    if (bps >= 1e12)
        snprintf(buf, size, "%.4g Tbit/s", bps / 1e12);
    else if (bps >= 1e9)
        snprintf(buf, size, "%.4g Gbit/s", bps / 1e9);
    else if (bps >= 1e6)
        snprintf(buf, size, "%.4g Mbit/s", bps / 1e6);
    else if (bps >= 1e3)
        snprintf(buf, size, "%.4g kbit/s", bps / 1e3);
    else
        snprintf(buf, size, "%.4g bit/s", bps);
}

/* Whether text starts as a number we take: a digit or a point (no sign, no blank, no "inf"). */
static int starts_unsigned(const char *text)
{
    return text && (isdigit((unsigned char)*text) || *text == '.');
}

int hapi_policy_parse_time(const char *text, double *seconds, hapi_error *err)
{
    char *end;
    errno = 0;
    double v = starts_unsigned(text) ? strtod(text, &end) : NAN;
    if (errno || !isfinite(v))
        return hapi_error_set(err, HAPI_EINVAL, "time '%s': expected e.g. 1ms, 500us, 0",
                              text ? text : "");
    double unit = 1e-3; /* a bare number is milliseconds, as ping prints it */
    if (strcmp(end, "s") == 0)
        unit = 1;
    else if (strcmp(end, "us") == 0)
        unit = 1e-6;
    else if (*end && strcmp(end, "ms") != 0)
        return hapi_error_set(err, HAPI_EINVAL, "time '%s': unknown unit '%s' (s, ms, us)",
                              text, end);
    *seconds = v * unit;
    return 0;
}

int hapi_policy_parse_size(const char *text, uint64_t *bytes, hapi_error *err)
{
    char *end;
    errno = 0;
    double v = starts_unsigned(text) ? strtod(text, &end) : NAN;
    if (errno || !isfinite(v))
        goto bad;
    double mult = 1;
    switch (toupper((unsigned char)*end)) {
    case '\0': break;
    case 'K': mult = 1024.0; end++; break;
    case 'M': mult = 1024.0 * 1024; end++; break;
    case 'G': mult = 1024.0 * 1024 * 1024; end++; break;
    case 'T': mult = 1024.0 * 1024 * 1024 * 1024; end++; break;
    case 'B': break;
    default: goto bad;
    }
    if (mult > 1 && (*end == 'i' || *end == 'I'))
        end++;
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end)
        goto bad;
    v *= mult;
    if (v >= 18446744073709551615.0)
        goto bad;
    *bytes = (uint64_t)v;
    return 0;
bad:
    return hapi_error_set(err, HAPI_EINVAL, "size '%s': expected e.g. 8G, 512M, 0",
                          text ? text : "");
}

/* A decimal number, the whole of text: 0 or HAPI_EINVAL. */
static int parse_float(const char *text, double *out)
{
    char *end;
    errno = 0;
    double v = text && *text && !isspace((unsigned char)*text) ? strtod(text, &end) : NAN;
    if (errno || !isfinite(v) || *end)
        return HAPI_EINVAL;
    *out = v;
    return 0;
}

/* A whole number in decimal digits (a sign allowed), the whole of text: 0 or HAPI_EINVAL. */
static int parse_whole(const char *text, double *out)
{
    char *end;
    errno = 0;
    long long v = text && *text && !isspace((unsigned char)*text) ? strtoll(text, &end, 10) : 0;
    if (!text || !*text || isspace((unsigned char)*text) || errno || *end)
        return HAPI_EINVAL;
    *out = (double)v;
    return 0;
}

/* What a value of each kind is called in a refusal. */
static const char *kind_noun(int kind)
{
    switch (kind) {
    case HAPI_INPUT_RATE: return "a link rate";
    case HAPI_INPUT_TIME: return "a time";
    case HAPI_INPUT_SIZE: return "a size";
    case HAPI_INPUT_INT: return "a whole number";
    case HAPI_INPUT_MS_LIST: return "ms per sample of each stage, each";
    default: return "a number";
    }
}

/* An example of a value of each input, for the refusal. */
static const char *example(const hapi_policy_input_spec *s)
{
    switch (s->kind) {
    case HAPI_INPUT_RATE: return ", e.g. 1Gbit or 125MB/s";
    case HAPI_INPUT_TIME: return ", e.g. 1ms or 200us";
    case HAPI_INPUT_SIZE: return ", e.g. 8G or 0";
    case HAPI_INPUT_MS_LIST: return ", e.g. 0.8,2.1,3.4";
    default: return "";
    }
}

/*
 * The one refusal of every input: "NAME TEXT: [FAULT; ]expected NOUN in RANGE[ (UNIT)][, e.g.
 * ...][, or WORD]". fault says what a rate's text lacks before the range (NULL: nothing).
 */
static int refuse(const hapi_policy_input_spec *s, const char *text, const char *fault,
                  hapi_error *err)
{
    if (s->kind == HAPI_INPUT_ENUM)
        return hapi_error_set(err, HAPI_EINVAL, "%s %s: expected %s", s->name, text, s->range);
    int unit_shown = s->kind == HAPI_INPUT_FLOAT && strcmp(s->unit, "ms") == 0;
    return hapi_error_set(err, HAPI_EINVAL, "%s %s: %s%sexpected %s in %s%s%s%s%s", s->name,
                          text, fault ? fault : "", fault ? "; " : "", kind_noun(s->kind),
                          s->range, unit_shown ? " (ms)" : "", example(s),
                          s->words ? ", or " : "", s->words ? s->words : "");
}

/*
 * The value of one number of the input (every kind but ENUM and MS_LIST's list). On failure
 * *fault says what the text lacks, when more than the range is to say (in buf, size bytes).
 */
static int parse_number(const hapi_policy_input_spec *s, const char *text, double *out,
                        const char **fault, char *buf, size_t size)
{
    const char *unit;
    uint64_t bytes;
    *fault = NULL;
    switch (s->kind) {
    case HAPI_INPUT_RATE:
        switch (parse_rate(text, out, &unit)) {
        case RATE_OK: return 0;
        case RATE_NO_UNIT: *fault = "no unit, bits or bytes?"; break;
        case RATE_BPS: *fault = "'bps' is ambiguous (tc reads it as bytes), write Mbit or MB/s";
            break;
        case RATE_UNKNOWN_UNIT:
            snprintf(buf, size, "unknown unit '%s'", unit);
            *fault = buf;
            break;
        default: break;
        }
        return HAPI_EINVAL;
    case HAPI_INPUT_TIME:
        return hapi_policy_parse_time(text, out, NULL);
    case HAPI_INPUT_SIZE:
        if (hapi_policy_parse_size(text, &bytes, NULL) < 0)
            return HAPI_EINVAL;
        *out = (double)bytes;
        return 0;
    case HAPI_INPUT_INT:
        return parse_whole(text, out);
    default:
        return parse_float(text, out);
    }
}

int hapi_policy_input_parse(const char *name, const char *text, hapi_policy_input_value *out,
                            hapi_error *err)
{
    const hapi_policy_input_spec *s = hapi_policy_input_find(name);
    const char *fault = NULL;
    char fault_text[96];
    if (!s)
        return hapi_error_set(err, HAPI_EINVAL, "%s: not an input of the policy",
                              name ? name : "(null)");
    if (!text)
        text = "";
    memset(out, 0, sizeof(*out));
    out->spec = s;
    if (s->kind == HAPI_INPUT_ENUM) {
        /* the words' index: "file|pack" gives file 0, pack 1 (enum hapi_policy_transport) */
        size_t len = strlen(text);
        int index = 0;
        for (const char *w = s->words; *w; index++) {
            size_t n = strcspn(w, "|");
            if (len && n == len && strncmp(w, text, n) == 0) {
                out->number = index;
                return 0;
            }
            w += n + (w[n] == '|');
        }
        return refuse(s, text, NULL, err);
    }
    if (s->words && strcmp(text, s->words) == 0) {
        out->is_word = 1;
        out->number = -1;
        return 0;
    }
    if (s->kind != HAPI_INPUT_MS_LIST) {
        if (parse_number(s, text, &out->number, &fault, fault_text, sizeof(fault_text)) < 0 || !(out->number >= s->min) ||
            !(out->number <= s->max))
            return refuse(s, text, fault, err);
        return 0;
    }
    /* numbers separated by commas, each a whole item: "0.8,2.1" but not "0.8,,2.1" */
    const char *p = text;
    for (;;) {
        char item[64];
        size_t n = strcspn(p, ",");
        if (out->count == HAPI_PROFILE_MAX_STAGES) {
            snprintf(fault_text, sizeof(fault_text), "more than %d stages",
                     HAPI_PROFILE_MAX_STAGES);
            return refuse(s, text, fault_text, err);
        }
        if (n == 0 || n >= sizeof(item))
            return refuse(s, text, NULL, err);
        memcpy(item, p, n);
        item[n] = '\0';
        double v;
        if (parse_float(item, &v) < 0 || !(v >= s->min) || !(v <= s->max))
            return refuse(s, text, NULL, err);
        out->list[out->count++] = v;
        if (!p[n])
            return 0;
        p += n + 1;
    }
}
