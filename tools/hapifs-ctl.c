/* hapifs-ctl.c — the operator's client of a mount's .hapifs/ files: status, stats, warm-up, eviction. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "policy.h"

enum { EXIT_USAGE = 1, EXIT_NOT_MOUNT = 2, EXIT_REFUSED = 3 };

static const char usage_text[] =
    "usage: hapifs-ctl [--json] COMMAND [ARGS] [MOUNTPOINT]\n"
    "\n"
    "commands:\n"
    "    status             one screen: model, weights, preprocessing, split, features,\n"
    "                       cache, reads, warm-up\n"
    "    stats              the mount's counters (feat, batcher, warm, prefetch, cache)\n"
    "    config             the mount's configuration\n"
    "    errors             the recent errors\n"
    "    profile            what each stage costs on the storage node (a table)\n"
    "    policy             every candidate split estimated, the chosen one marked, and why\n"
    "    set-split N|NAME|auto   serve another split (auto: the policy's); files open now\n"
    "                       keep theirs, the next open sees the new shape\n"
    "    set-batch N|auto   the storage-side batch\n"
    "    set-link RATE      tell the policy the link's rate (e.g. 1Gbit, 100Mbit, 125MB/s)\n"
    "    set-rtt TIME       ... the link's round-trip time (e.g. 1ms, 0)\n"
    "    set-link-bytes X|any  ... the most a split's .feat may put on the link, in source\n"
    "                       images' bytes (1: never more than the images; any: no bound)\n"
    "    set-client-speed X ... the compute tier's speed relative to this node, as measured\n"
    "                       there (examples/probe-speed.py prints it)\n"
    "    set-compute-stages MS,MS,...|none  ... the compute tier's ms per sample of each frozen\n"
    "                       stage at its training batch (probe-speed.py prints them)\n"
    "    set-compute-file-ms MS|default  ... its training loop's CPU per file beside the\n"
    "                       stages (probe-speed.py prints it)\n"
    "    set-compute-cache SIZE  ... how many bytes of .feat files the compute tier keeps\n"
    "                       between epochs (its page cache; 0: none)\n"
    "    warm [PATH]        compute the features of PATH (default: everything), showing progress\n"
    "    evict [all|PATH]   drop cached features of the mount, or of PATH\n"
    "\n"
    "MOUNTPOINT defaults to the hapifs mount containing the current directory.\n"
    "    --json             print JSON\n"
    "    -h, --help         this help\n";

static int json_output;

static void say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("hapifs-ctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static int has_config(const char *dir)
{
    char path[PATH_MAX + 32];
    struct stat st;
    snprintf(path, sizeof(path), "%s/.hapifs/config", strcmp(dir, "/") ? dir : "");
    return stat(path, &st) == 0;
}

/* Walks up from dir (absolute) to the nearest directory with .hapifs/config; 1 if found. */
static int walk_up(const char *dir, char *mnt)
{
    snprintf(mnt, PATH_MAX, "%s", dir);
    for (;;) {
        if (has_config(mnt))
            return 1;
        char *slash = strrchr(mnt, '/');
        if (!slash || strcmp(mnt, "/") == 0)
            return 0;
        slash[slash == mnt ? 1 : 0] = '\0';
    }
}

/* Fills mnt (PATH_MAX) with the mount's absolute path: the one given, else the one holding
   path (if it exists), else the one holding the current directory. Returns 0 or an exit code
   after saying why. */
static int find_mount(const char *arg, const char *path, char *mnt)
{
    char start[PATH_MAX];
    if (arg) {
        if (!realpath(arg, mnt) || !has_config(mnt)) {
            say("%s: not a hapifs mount (no .hapifs/config)", arg);
            return EXIT_NOT_MOUNT;
        }
        return 0;
    }
    if (path && realpath(path, start) && walk_up(start, mnt))
        return 0;
    if (!getcwd(start, sizeof(start))) {
        say("cannot find the current directory: %s", strerror(errno));
        return EXIT_NOT_MOUNT;
    }
    if (walk_up(start, mnt))
        return 0;
    say("%s: not a hapifs mount (no .hapifs/config)", start);
    return EXIT_NOT_MOUNT;
}

/* Reads MNT/.hapifs/NAME; NULL after saying why. The caller owns the result. */
static json_t *load(const char *mnt, const char *name)
{
    char path[PATH_MAX + 32];
    json_error_t err;
    snprintf(path, sizeof(path), "%s/.hapifs/%s", mnt, name);
    json_t *j = json_load_file(path, 0, &err);
    if (!j)
        say("%s: %s", path, err.text);
    return j;
}

/* The value at a dotted path such as "cache.namespace.entries" or "preprocess.mean.0" (an
 * array's element by its index), or NULL. Borrowed. */
static json_t *get(json_t *o, const char *path)
{
    char key[64];
    while (o && *path) {
        size_t n = strcspn(path, ".");
        snprintf(key, sizeof(key), "%.*s", (int)n, path);
        o = json_is_array(o) ? json_array_get(o, strtoul(key, NULL, 10))
                             : json_object_get(o, key);
        path += n + (path[n] == '.');
    }
    return o;
}

static double num(json_t *o, const char *path) { return json_number_value(get(o, path)); }

static const char *str(json_t *o, const char *path)
{
    const char *s = json_string_value(get(o, path));
    return s ? s : "?";
}

static const char *human_size(double bytes, char *buf, size_t size)
{
    static const char *units[] = { "B", "KiB", "MiB", "GiB", "TiB" };
    int u = 0;
    while (bytes >= 1024 && u < 4) {
        bytes /= 1024;
        u++;
    }
    snprintf(buf, size, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
    return buf;
}

static const char *human_time(double s, char *buf, size_t size)
{
    if (s < 0)
        snprintf(buf, size, "?");
    else if (s < 1)
        snprintf(buf, size, "%.0fms", s * 1e3);
    else if (s < 10)
        snprintf(buf, size, "%.2fs", s);
    else if (s < 60)
        snprintf(buf, size, "%.0fs", s);
    else if (s < 3600)
        snprintf(buf, size, "%dm%02ds", (int)s / 60, (int)s % 60);
    else
        snprintf(buf, size, "%dh%02dm", (int)(s / 3600), (int)s % 3600 / 60);
    return buf;
}

static void print_scalar(json_t *v)
{
    if (json_is_string(v))
        fputs(json_string_value(v), stdout);
    else if (json_is_real(v))
        printf("%.3f", json_real_value(v));
    else {
        char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(6));
        fputs(s ? s : "?", stdout);
        free(s);
    }
}

/* Objects become indented sections, in the order the mount wrote them. */
static void print_object(json_t *o, int depth)
{
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        printf("%*s%s:", depth * 2, "", key);
        if (json_is_object(v)) {
            putchar('\n');
            print_object(v, depth + 1);
            continue;
        }
        /* A list of objects (the model's stages) gets a line per element. */
        if (json_is_array(v) && json_is_object(json_array_get(v, 0))) {
            size_t i;
            json_t *e;
            putchar('\n');
            json_array_foreach(v, i, e) {
                printf("%*s- ", depth * 2 + 2, "");
                print_scalar(e);
                putchar('\n');
            }
            continue;
        }
        putchar(' ');
        print_scalar(v);
        putchar('\n');
    }
}

static void print_warm_line(json_t *w)
{
    char a[32];
    const char *state = str(w, "state");
    printf("%-10s %s", "warm", state);
    if (strcmp(state, "idle") != 0) {
        double total = num(w, "total"), done = num(w, "done");
        int over = strcmp(state, "done") == 0 || strcmp(state, "stopped") == 0;
        printf(" '/%s': %.0f/%.0f (%.0f%%), computed %.0f, cached %.0f, skipped %.0f, %.1f/s, "
               "%s %s", str(w, "path"), done, total, total > 0 ? 100 * done / total : 100.0,
               num(w, "computed"), num(w, "cached"), num(w, "skipped"), num(w, "rate_per_s"),
               over ? "took" : "ETA",
               human_time(over ? num(w, "elapsed_s") : num(w, "eta_s"), a, sizeof(a)));
    }
    putchar('\n');
}

/*
 * The status lines of what the features are of: the architecture and its arithmetic, the
 * weights (random ones say so, as the exporter warned) and the preprocessing the archive names.
 * A field an older daemon or archive lacks prints as "?".
 */
static void print_model(json_t *config)
{
    printf("%-10s %s, %s arithmetic  %s\n", "model", str(config, "model.arch"),
           str(config, "model.precision"), str(config, "model.path"));
    const char *weights = json_string_value(get(config, "model.weights"));
    const char *named = json_string_value(get(config, "model.weights_enum"));
    printf("%-10s ", "weights");
    if (!weights)
        fputs("?", stdout);
    else if (strncmp(weights, "random:seed=", 12) == 0)
        printf("random (seed %s): the features describe no trained model", weights + 12);
    else
        fputs(strncmp(weights, "file:", 5) == 0 ? weights + 5 : weights, stdout);
    if (named)
        printf(" (%s)", named);
    printf("\n%-10s %s: %s resize %.0f, crop %.0f, mean [%.3g, %.3g, %.3g], std [%.3g, %.3g, "
           "%.3g]\n", "preprocess", str(config, "preprocess.mode"),
           str(config, "preprocess.interpolation"), num(config, "preprocess.resize"),
           num(config, "preprocess.crop"), num(config, "preprocess.mean.0"),
           num(config, "preprocess.mean.1"), num(config, "preprocess.mean.2"),
           num(config, "preprocess.std.0"), num(config, "preprocess.std.1"),
           num(config, "preprocess.std.2"));
}

static int cmd_status(const char *mnt)
{
    json_t *config = load(mnt, "config"), *stats = config ? load(mnt, "stats") : NULL;
    if (!stats) {
        json_decref(config);
        return EXIT_NOT_MOUNT;
    }
    if (json_output) {
        json_t *both = json_pack("{s:O, s:O}", "config", config, "stats", stats);
        json_dumpf(both, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        putchar('\n');
        json_decref(both);
        goto out;
    }
    char s1[32], s2[32], s3[32], t[32];
    char *shape = json_dumps(get(config, "split.shape"), JSON_COMPACT);
    printf("%-10s %s (hapifs %s, up %s)\n", "mount", mnt, str(config, "version"),
           human_time(num(stats, "uptime_s"), t, sizeof(t)));
    printf("%-10s %s\n", "source", str(config, "source"));
    print_model(config);
    printf("%-10s index %.0f: stages [0, %.0f) of %zu, through '%s', output %s\n", "split",
           num(config, "split.index"), num(config, "split.index"),
           json_array_size(get(config, "model.stages")), str(config, "split.stage"),
           shape ? shape : "?");
    printf("%-10s %s, %s per file\n", "features", str(config, "split.dtype"),
           human_size(num(config, "split.feat_size"), s1, sizeof(s1)));
    size_t nstages = json_array_size(get(config, "policy.compute_stages_ms"));
    printf("%-10s split by %s; link %s, rtt %.3g ms, %s transport; compute tier %.3gx this "
           "node", "policy", str(config, "split.by"), str(config, "policy.link"),
           num(config, "policy.rtt_ms"), str(config, "policy.transport"),
           num(config, "policy.client_speed"));
    if (nstages)
        printf(", its stages measured there (%zu)", nstages);
    else
        printf(" (client_speed)");
    printf(", its loop %.3g ms a file%s\n", num(config, "policy.compute_file_ms"),
           json_is_true(get(config, "policy.compute_file_ms_given")) ? " (measured there)"
                                                                      : " (the default)");
    printf("%-10s %s namespace %.12s: %.0f entries, %s (all: %.0f entries, %s of %s)\n",
           "cache", str(config, "cache.dir"), str(config, "cache.namespace"),
           num(stats, "cache.namespace.entries"),
           human_size(num(stats, "cache.namespace.bytes"), s1, sizeof(s1)),
           num(stats, "cache.entries"), human_size(num(stats, "cache.bytes_used"), s2, sizeof(s2)),
           human_size(num(stats, "cache.size_limit"), s3, sizeof(s3)));
    printf("%-10s %.0f (hits %.0f, misses %.0f, computed %.0f, failed %.0f)\n", "reads",
           num(stats, "feat.reads"), num(stats, "feat.hits"), num(stats, "feat.misses"),
           num(stats, "feat.computed"), num(stats, "feat.failed"));
    print_warm_line(get(stats, "warm"));
    if (get(stats, "prefetch")) /* a daemon before prefetch has no such section */
        printf("%-10s %s: %.0f directories (%.0f waiting, %.0f dropped), %.0f queued, "
               "%.0f cached, %.0f computed first\n", "prefetch", str(stats, "prefetch.mode"),
               num(stats, "prefetch.dirs"), num(stats, "prefetch.pending_dirs"),
               num(stats, "prefetch.dropped"), num(stats, "prefetch.submitted"),
               num(stats, "prefetch.cached"), num(stats, "prefetch.computed"));
    if (json_is_object(get(stats, "node"))) { /* null: the mount runs alone */
        char s4[32];
        printf("%-10s %.0f mounts hold %s of %s; this one %s (model) + %s in flight; "
               "cores %.0f of %.0f busy, %.0f inferences waiting\n", "node",
               num(stats, "node.mounts"), human_size(num(stats, "node.mem_used"), s1, sizeof(s1)),
               human_size(num(stats, "node.mem_total"), s2, sizeof(s2)),
               human_size(num(stats, "node.own_fixed"), s3, sizeof(s3)),
               human_size(num(stats, "node.own_flight"), s4, sizeof(s4)),
               num(stats, "node.cores_used"), num(stats, "node.cores"), num(stats, "node.waiting"));
    }
    free(shape);
out:
    json_decref(config);
    json_decref(stats);
    return 0;
}

/* stats, config: the JSON as it is, or as indented sections. */
static int cmd_show(const char *mnt, const char *name)
{
    json_t *j = load(mnt, name);
    if (!j)
        return EXIT_NOT_MOUNT;
    if (json_output) {
        json_dumpf(j, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        putchar('\n');
    } else {
        print_object(j, 0);
    }
    json_decref(j);
    return 0;
}

static int cmd_errors(const char *mnt)
{
    json_t *j = load(mnt, "errors");
    if (!j)
        return EXIT_NOT_MOUNT;
    json_t *list = json_object_get(j, "errors"), *e;
    size_t i;
    if (json_output) {
        json_dumpf(j, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        putchar('\n');
    } else if (json_array_size(list) == 0) {
        puts("no errors");
    } else {
        if (num(j, "count") > (double)json_array_size(list))
            printf("%.0f errors since the mount; the last %zu:\n", num(j, "count"),
                   json_array_size(list));
        json_array_foreach(list, i, e) {
            printf("%s  %s  %s", str(e, "time"), str(e, "path"), str(e, "error"));
            if (num(e, "repeats") > 0)
                printf(" (repeated %.0f times)", num(e, "repeats"));
            putchar('\n');
        }
    }
    json_decref(j);
    return 0;
}

/* Turns PATH (in the mount, from the current directory, or relative to the mount's root) into
   the source name the ctl file expects: x.jpg.feat becomes x.jpg. */
static int source_name(const char *mnt, const char *arg, char *out, size_t size)
{
    char real[PATH_MAX];
    size_t n = strlen(mnt);
    const char *rel = arg;
    if (realpath(arg, real) && strncmp(real, mnt, n) == 0 && (real[n] == '/' || !real[n]))
        rel = real + n;
    else if (arg[0] == '/') {
        if (strncmp(arg, mnt, n) != 0 || (arg[n] != '/' && arg[n]))
            return say("%s: not beneath the mount %s", arg, mnt), EXIT_USAGE;
        rel = arg + n;
    }
    while (*rel == '/')
        rel++;
    if (strpbrk(rel, " \t\r\n"))
        return say("'%s': the ctl file takes no paths with blanks", arg), EXIT_USAGE;
    snprintf(out, size, "%s", rel);
    size_t len = strlen(out);
    while (len && out[len - 1] == '/')
        out[--len] = '\0';
    static const char *images[] = { ".jpg.feat", ".jpeg.feat", ".png.feat" };
    for (int i = 0; i < 3; i++) {
        size_t k = strlen(images[i]);
        if (len > k && strcasecmp(out + len - k, images[i]) == 0)
            out[len - 5] = '\0';
    }
    return 0;
}

/*
 * The mount's reason for refusing the command just written on fd: a read of
 * the same open ctl file returns "error: REASON". Fills why (empty if none).
 */
static void refusal(int fd, char *why, size_t size)
{
    char buf[1024];
    ssize_t r = pread(fd, buf, sizeof(buf) - 1, 0);
    why[0] = '\0';
    if (r <= 0)
        return;
    buf[r] = '\0';
    if (strncmp(buf, "error: ", 7) != 0)
        return;
    char *nl = strchr(buf, '\n');
    if (nl)
        *nl = '\0';
    snprintf(why, size, "%s", buf + 7);
}

/* Writes one command line to ctl; returns 0 or EXIT_REFUSED after printing why. */
static int send(const char *mnt, const char *command, const char *path)
{
    char file[PATH_MAX + 32], line[PATH_MAX + 32], why[1024] = "";
    int n = snprintf(line, sizeof(line), "%s%s%s\n", command, *path ? " " : "", path);
    snprintf(file, sizeof(file), "%s/.hapifs/ctl", mnt);
    int fd = open(file, O_RDWR);
    int rc = fd < 0 || write(fd, line, (size_t)n) != n ? -errno : 0;
    if (rc < 0 && fd >= 0)
        refusal(fd, why, sizeof(why));
    if (fd >= 0 && close(fd) < 0 && rc == 0)
        rc = -errno;
    if (rc < 0) {
        say("%s%s%s: %s", command, *path ? " " : "", path, *why ? why : strerror(-rc));
        return EXIT_REFUSED;
    }
    return 0;
}

static void draw_progress(json_t *w, int tty)
{
    char bar[31], eta[32];
    double total = num(w, "total"), done = num(w, "done");
    if (strcmp(str(w, "state"), "counting") == 0) {
        fprintf(stderr, "%swarm: counting files... %.0f%s", tty ? "\r" : "", total,
                tty ? "\033[K" : "\n");
        return;
    }
    double frac = total > 0 ? done / total : 1;
    int fill = (int)(frac * 30);
    for (int i = 0; i < 30; i++)
        bar[i] = i < fill ? '#' : '-';
    bar[30] = '\0';
    fprintf(stderr, "%swarm [%s] %.0f/%.0f %5.1f%%  %.1f/s  ETA %s%s", tty ? "\r" : "", bar, done,
            total, 100 * frac, num(w, "rate_per_s"), human_time(num(w, "eta_s"), eta, sizeof(eta)),
            tty ? "\033[K" : "\n");
}

static int cmd_warm(const char *mnt, const char *path)
{
    int rc = send(mnt, "warm", path);
    if (rc)
        return rc;
    int tty = isatty(STDERR_FILENO);
    double last_done = -1;
    time_t last_line = 0;
    for (;;) {
        json_t *stats = load(mnt, "stats");
        if (!stats)
            return EXIT_NOT_MOUNT;
        json_t *w = get(stats, "warm");
        /* done, or stopped by a "warm stop" written to ctl meanwhile */
        int stopped = strcmp(str(w, "state"), "stopped") == 0;
        int finished = stopped || strcmp(str(w, "state"), "done") == 0;
        /* Away from a terminal a line per second at most, and only when something moved. */
        if (tty || finished || (num(w, "done") != last_done && time(NULL) != last_line)) {
            draw_progress(w, tty);
            last_done = num(w, "done");
            last_line = time(NULL);
        }
        if (finished) {
            if (tty)
                fputc('\n', stderr);
            if (json_output) {
                json_dumpf(w, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
                putchar('\n');
            } else {
                print_warm_line(w);
            }
            json_decref(stats);
            if (stopped)
                say("warm: the warm-up was stopped (warm stop) before it was done");
            return stopped ? EXIT_REFUSED : 0;
        }
        json_decref(stats);
        nanosleep(&(struct timespec){ .tv_nsec = 250 * 1000 * 1000 }, NULL);
    }
}

static int cmd_evict(const char *mnt, const char *path)
{
    json_t *before = load(mnt, "stats");
    if (!before)
        return EXIT_NOT_MOUNT;
    int rc = send(mnt, "evict", *path ? path : "all");
    json_t *after = rc ? NULL : load(mnt, "stats");
    if (!rc && !after)
        rc = EXIT_NOT_MOUNT;
    if (!rc) {
        double was = num(before, "cache.namespace.entries");
        double now = num(after, "cache.namespace.entries");
        double gone = was > now ? was - now : 0;
        if (json_output) {
            json_t *result = json_pack("{s:s, s:s, s:I, s:I}", "command", "evict", "path",
                                       *path ? path : "all", "evicted", (json_int_t)gone,
                                       "entries", (json_int_t)now);
            json_dumpf(result, stdout, JSON_COMPACT | JSON_PRESERVE_ORDER);
            putchar('\n');
            json_decref(result);
        } else
            printf("evicted %.0f cached features of '%s'; %.0f left in this mount's namespace\n",
                   gone, *path ? path : "all", now);
    }
    json_decref(before);
    json_decref(after);
    return rc;
}

static void print_json(json_t *j)
{
    json_dumpf(j, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    putchar('\n');
}

/* A state other than ready ("measuring", "failed") is said and ends the command. */
static int not_ready(json_t *j, const char *what)
{
    const char *state = str(j, "state");
    if (strcmp(state, "measuring") == 0) {
        say("the model is still being profiled; try again in a moment");
        return EXIT_REFUSED;
    }
    if (strcmp(state, "failed") == 0) {
        say("no %s: %s", what, str(j, "error"));
        return EXIT_REFUSED;
    }
    return 0;
}

static int cmd_profile(const char *mnt)
{
    json_t *p = load(mnt, "profile");
    if (!p)
        return EXIT_NOT_MOUNT;
    int rc = not_ready(p, "profile");
    if (rc || json_output) {
        if (!rc)
            print_json(p);
        json_decref(p);
        return rc;
    }
    json_t *batches = json_object_get(p, "batches"), *st;
    char a[32], b[32], c[32];
    size_t i, k;
    printf("model %.12s on %s, %.0f torch threads, %.0f cores", str(p, "model_digest"),
           str(p, "device"), num(p, "threads"), num(p, "cores"));
    if (num(p, "cpu_quota") > 0)
        printf(" (a CPU quota of %.3g)", num(p, "cpu_quota"));
    printf("; %s %s (%.1f s, %.0f sweeps)\n",
           strcmp(str(p, "state"), "stored") == 0 ? "stored profile" : "measured at mount",
           human_time(time(NULL) - num(p, "measured_at"), a, sizeof(a)), num(p, "seconds"),
           num(p, "sweeps"));
    printf("decode + preprocess %.2f ms per image (%.0f images, %s each on average)\n\n",
           num(p, "decode_ms"), num(p, "decode_samples"),
           human_size(num(p, "source_bytes"), a, sizeof(a)));
    printf("%-3s %-10s %-16s %10s %10s", "#", "stage", "output", "fp32", "fp16");
    json_array_foreach(batches, k, st)
        printf("  ms@b%-4lld", (long long)json_integer_value(st));
    printf(" %12s %10s\n", "mem/sample", "weights");
    json_array_foreach(json_object_get(p, "stages"), i, st) {
        char *shape = json_dumps(json_object_get(st, "shape"), JSON_COMPACT);
        printf("%-3zu %-10s %-16s %10s %10s", i, str(st, "name"), shape ? shape : "?",
               human_size(num(st, "bytes_fp32"), a, sizeof(a)),
               human_size(num(st, "bytes_fp16"), b, sizeof(b)));
        json_t *ms = json_object_get(st, "ms_per_sample");
        for (k = 0; k < json_array_size(batches); k++)
            printf("  %8.3f", json_number_value(json_array_get(ms, k)));
        printf(" %12s %10s\n", human_size(num(st, "mem_per_sample"), c, sizeof(c)),
               human_size(num(st, "param_bytes"), a, sizeof(a)));
        free(shape);
    }
    printf("\nms@bN: wall ms per sample of the stage alone at batch N; mem/sample: its peak\n"
           "working memory per sample (%s).\n",
           json_is_true(json_object_get(p, "memory_measured")) ? "measured" : "estimated");
    json_decref(p);
    return 0;
}

/* The terms of the chosen candidate's estimate, one tier a line, from .hapifs/policy;
   file_given: the loop's cost per file was given (config's policy.compute_file_ms_given). */
static void explain_terms(json_t *p, int file_given)
{
    json_t *c = NULL, *k;
    size_t i;
    json_array_foreach(json_object_get(p, "candidates"), i, k)
        if (json_is_true(json_object_get(k, "chosen")))
            c = k;
    if (!c)
        return;
    char a[32], b[32], t1[32], t2[32], t3[32];
    int pack = strcmp(str(p, "inputs.transport"), "pack") == 0;
    printf("\nterms of split %.0f (%s), per sample:\n", num(c, "split"), str(c, "stage"));
    printf("  storage  %.3f ms: decode and stages [0, %.0f) at batch %.0f, from the profile, and\n"
           "           %.3f ms to serve a feature computed on demand; a cached one costs %.3f ms\n"
           "           instead (%.0f%% cached now, %.0f%% by a later epoch); plus %.3f ms of\n"
           "           transport CPU per file (sftp server, ssh); a CPU quota below one CPU\n"
           "           slows all but the profile's figures, which were measured under it\n",
           num(c, "storage_ms"), num(c, "split"), num(c, "batch"),
           num(p, "inputs.storage_serve_ms"), num(p, "inputs.hit_ms"), 100 * num(c, "cached"),
           100 * num(c, "storage_fit"), num(p, "inputs.storage_file_ms"));
    if (pack)
        printf("  link     %.3f ms: the features' row and index entry in a pack at %s; later\n"
               "           epochs read the compute-side cache\n",
               num(c, "link_pack_ms"), str(p, "inputs.link"));
    else
        printf("  link     %.3f ms, the larger of\n"
               "             bytes %.3f ms: %s and %.0f B of requests at %s\n"
               "             readers %.3f ms: %.0f round trips x (%.3g ms rtt + %.3g ms a "
               "request),\n"
               "               then the reader's own %.3f ms on the file, over %.0f readers\n"
               "           a later epoch %.3f ms: the compute tier keeps %.0f%% of the files "
               "(%s);\n"
               "           a kept file costs only its open and close\n",
               num(c, "link_file_ms"), num(c, "link_bytes_ms"),
               human_size(num(c, "file_bytes"), a, sizeof(a)), num(p, "inputs.file_overhead_bytes"),
               str(p, "inputs.link"), num(c, "link_trips_ms"), num(p, "inputs.file_round_trips"),
               num(p, "inputs.rtt_ms"), num(p, "inputs.request_ms"), num(c, "reader_ms"),
               num(p, "inputs.readers"),
               num(c, "link_warm_ms"), 100 * num(c, "compute_kept"),
               human_size(num(p, "inputs.compute_cache"), b, sizeof(b)));
    json_t *measured = get(p, "inputs.compute_stages_ms");
    size_t nmeasured = json_array_size(measured);
    char how[96];
    if (nmeasured >= num(p, "inputs.freeze"))
        snprintf(how, sizeof(how), "as measured on the compute tier (compute_stages)");
    else if (nmeasured > num(c, "split"))
        snprintf(how, sizeof(how), "[%.0f, %zu) as measured there, the rest at %.3gx",
                 num(c, "split"), nmeasured, num(p, "inputs.client_speed"));
    else
        snprintf(how, sizeof(how), "at %.3gx this node's speed (client_speed)",
                 num(p, "inputs.client_speed"));
    printf("  compute  %.3f ms: stages [%.0f, %.0f) %s;\n"
           "           plus the reader's %.3f ms a file: %.3f ms of the training loop beside\n"
           "           the stages (ssh, sshfs, the loader, the head's step; %s),\n"
           "           %.3g ns per byte loaded (%.3f ms a file, every epoch) and %.3g ns per\n"
           "           byte received across the link (%.3f ms a file, in the epochs that read\n"
           "           it there)\n",
           num(c, "compute_ms"), num(c, "split"), num(p, "inputs.freeze"), how,
           num(c, "reader_ms"), num(p, "inputs.compute_file_ms"),
           file_given ? "measured there" : "a default: probe-speed.py measures it",
           num(p, "inputs.compute_load_ns"),
           num(c, "file_bytes") * num(p, "inputs.compute_load_ns") / 1e6,
           num(p, "inputs.compute_byte_ns"),
           num(c, "file_bytes") * num(p, "inputs.compute_byte_ns") / 1e6);
    double cached = num(c, "cached");
    char part[64] = "";
    if (cached > 0 && cached < 1)
        snprintf(part, sizeof(part), " for the %.0f%% computed on demand", 100 * (1 - cached));
    if (!pack && cached >= 1)
        printf("  every feature is cached, so a first epoch as a later one takes its slowest\n"
               "  tier:\n");
    else if (!pack)
        printf("  a first epoch takes the %g-norm of its tiers%s (shuffled reads wait on a"
               " storage\n  tier computing a folder at a time)%s, a later one its slowest tier:\n",
               num(p, "inputs.cold_norm"), part,
               part[0] ? ", the slowest for the cached rest" : "");
    else
        printf("  an epoch takes its slowest tier:");
    printf("%s first %s (%s-bound), later %s (%s-bound);\n"
           "  %.0f epochs %s\n", pack ? "" : " ",
           human_time(num(c, "cold_epoch_s"), t1, sizeof(t1)), str(c, "cold_bound"),
           human_time(num(c, "warm_epoch_s"), t2, sizeof(t2)), str(c, "warm_bound"),
           num(p, "inputs.epochs"), human_time(num(c, "total_s"), t3, sizeof(t3)));
}

static int cmd_policy(const char *mnt)
{
    json_t *p = load(mnt, "policy");
    if (!p)
        return EXIT_NOT_MOUNT;
    int rc = not_ready(p, "policy");
    if (rc || json_output) {
        if (!rc)
            print_json(p);
        json_decref(p);
        return rc;
    }
    json_t *c;
    size_t i;
    char a[32];
    double samples = num(p, "epoch_samples");
    printf("inputs: link %s, compute tier %.3gx this node, %.0f epochs, mem %s, freeze %.0f, %s\n",
           str(p, "inputs.link"), num(p, "inputs.client_speed"), num(p, "inputs.epochs"),
           human_size(num(p, "inputs.mem_budget"), a, sizeof(a)), num(p, "inputs.freeze"),
           str(p, "inputs.dtype"));
    printf("transport %s, rtt %.3g ms, %.0f readers, compute tier keeps %s of .feat files\n",
           str(p, "inputs.transport"), num(p, "inputs.rtt_ms"), num(p, "inputs.readers"),
           human_size(num(p, "inputs.compute_cache"), a, sizeof(a)));
    if (num(p, "inputs.link_bytes") > 0 && num(p, "inputs.source_bytes") > 0)
        printf("a .feat may put at most %.3gx a source image's bytes on the link (%s)\n",
               num(p, "inputs.link_bytes"),
               human_size(num(p, "inputs.link_bytes") * num(p, "inputs.source_bytes"), a,
                          sizeof(a)));
    else
        printf("a .feat may put any number of bytes on the link%s\n",
               num(p, "inputs.link_bytes") > 0 ? " (the images' size is not measured yet)" : "");
    printf("epochs of %.0f samples%s\n\n", samples,
           num(p, "inputs.samples") > 0 ? "" : " (the tree is not counted yet: per 1000)");
    printf("  %-3s %-10s %5s %10s %9s %9s %9s %10s %10s %10s %7s  %s\n", "#", "stage", "batch",
           "file", "stor ms", "link ms", "comp ms", "1st epoch", "later", "total", "cached",
           "bound");
    json_t *all = json_copy(json_object_get(p, "candidates"));
    json_array_append(all, json_object_get(p, "raw"));
    json_array_foreach(all, i, c) {
        int raw = i + 1 == json_array_size(all);
        char idx[16] = "-", bat[16] = "-", size[32], t1[32], t2[32], t3[32];
        if (!raw) {
            snprintf(idx, sizeof(idx), "%.0f", num(c, "split"));
            snprintf(bat, sizeof(bat), "%.0f", num(c, "batch"));
        }
        printf("%s %-3s %-10s %5s %10s %9.3f %9.3f %9.3f %10s %10s %10s %6.0f%%  %s/%s%s\n",
               json_is_true(json_object_get(c, "chosen")) ? "*" : " ", idx, str(c, "stage"), bat,
               human_size(num(c, "file_bytes"), size, sizeof(size)), num(c, "storage_ms"),
               num(c, "link_ms"), num(c, "compute_ms"),
               human_time(num(c, "cold_epoch_s"), t1, sizeof(t1)),
               human_time(num(c, "warm_epoch_s"), t2, sizeof(t2)),
               human_time(num(c, "total_s"), t3, sizeof(t3)), 100 * num(c, "cached"),
               str(c, "cold_bound"), str(c, "warm_bound"),
               raw ? "  (raw images: the usual pipeline)"
               : !json_is_true(json_object_get(c, "fits")) ? "  (does not fit mem)"
               : json_is_false(json_object_get(c, "within_link_bytes")) ? "  (over link_bytes)"
                                                                         : "");
    }
    json_decref(all);
    printf("\n* %s\n", str(p, "why"));
    json_t *config = load(mnt, "config");
    explain_terms(p, config && json_is_true(get(config, "policy.compute_file_ms_given")));
    json_decref(config);
    if (get(p, "precision.auto"))
        printf("\nprecision %s, chosen by precision=auto %s: %s\n", str(p, "precision.name"),
               json_is_true(get(p, "precision.auto.stored")) ? "at an earlier mount"
                                                             : "at this mount",
               str(p, "precision.auto.why"));
    else if (get(p, "precision"))
        printf("\nprecision %s\n", str(p, "precision.name"));
    if (get(p, "current"))
        printf("\nserving split %.0f (%s), batch %.0f, set by the %s%s\n", num(p, "current.split"),
               str(p, "current.stage"), num(p, "current.batch"), str(p, "current.by"),
               json_is_true(get(p, "current.differs"))
                   ? "; the policy would pick another now (hapifs-ctl set-split auto)"
                   : "");
    json_decref(p);
    return 0;
}

/* set-split, set-batch, set-link, set-link-bytes, set-rtt, set-client-speed, set-compute-cache,
   set-compute-stages, set-compute-file-ms: one control command, then what the mount says now. */
static int cmd_set(const char *mnt, const char *cmd, const char *value)
{
    const char *command = strcmp(cmd, "set-split") == 0          ? "split"
                          : strcmp(cmd, "set-batch") == 0        ? "batch"
                          : strcmp(cmd, "set-rtt") == 0          ? "rtt"
                          : strcmp(cmd, "set-link-bytes") == 0   ? "link_bytes"
                          : strcmp(cmd, "set-client-speed") == 0 ? "client_speed"
                          : strcmp(cmd, "set-compute-cache") == 0 ? "compute_cache"
                          : strcmp(cmd, "set-compute-stages") == 0 ? "compute_stages"
                          : strcmp(cmd, "set-compute-file-ms") == 0 ? "compute_file_ms"
                                                                 : "link";
    /* A policy input is checked here as the mount would: the same range, the same words. */
    hapi_policy_input_value input;
    hapi_error err;
    if (hapi_policy_input_find(command) &&
        hapi_policy_input_parse(command, value, &input, &err) < 0)
        return say("%s", err.message), EXIT_REFUSED;
    int rc = send(mnt, command, value);
    if (rc)
        return rc;
    json_t *config = load(mnt, "config");
    if (!config)
        return EXIT_NOT_MOUNT;
    if (json_output) {
        json_t *j = json_pack("{s:s, s:s, s:O, s:O, s:O}", "command", command, "value", value,
                              "split", get(config, "split"), "batch",
                              get(config, "runtime.batch"), "policy", get(config, "policy"));
        print_json(j);
        json_decref(j);
    } else {
        char *shape = json_dumps(get(config, "split.shape"), JSON_COMPACT);
        char s1[32];
        printf("split %.0f (%s, by %s): .feat of %s, shape %s; batch %.0f%s; link %s, rtt %.3g "
               "ms, client_speed %.3g%s, compute_file_ms %.3g%s\n",
               num(config, "split.index"), str(config, "split.stage"), str(config, "split.by"),
               human_size(num(config, "split.feat_size"), s1, sizeof(s1)), shape ? shape : "?",
               num(config, "runtime.batch"),
               json_is_true(get(config, "runtime.batch_auto")) ? " (auto)" : "",
               str(config, "policy.link"), num(config, "policy.rtt_ms"),
               num(config, "policy.client_speed"),
               json_array_size(get(config, "policy.compute_stages_ms"))
                   ? ", compute stages measured" : "",
               num(config, "policy.compute_file_ms"),
               json_is_true(get(config, "policy.compute_file_ms_given")) ? "" : " (default)");
        free(shape);
    }
    json_decref(config);
    return 0;
}

int main(int argc, char *argv[])
{
    const char *words[4];
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json_output = 1;
        else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0)
            return fputs(usage_text, stdout), 0;
        else if (argv[i][0] == '-' && argv[i][1] && strcmp(argv[i], "--") != 0)
            return say("unknown option '%s'", argv[i]), fputs(usage_text, stderr), EXIT_USAGE;
        else if (n == 4)
            return say("too many arguments"), fputs(usage_text, stderr), EXIT_USAGE;
        else if (strcmp(argv[i], "--") != 0)
            words[n++] = argv[i];
    }
    if (n == 0)
        return say("no command given"), fputs(usage_text, stderr), EXIT_USAGE;
    const char *cmd = words[0];
    int takes_path = strcmp(cmd, "warm") == 0 || strcmp(cmd, "evict") == 0;
    int takes_value = strncmp(cmd, "set-", 4) == 0;
    int known = takes_path || strcmp(cmd, "status") == 0 || strcmp(cmd, "stats") == 0 ||
                strcmp(cmd, "config") == 0 || strcmp(cmd, "errors") == 0 ||
                strcmp(cmd, "profile") == 0 || strcmp(cmd, "policy") == 0 ||
                strcmp(cmd, "set-split") == 0 || strcmp(cmd, "set-batch") == 0 ||
                strcmp(cmd, "set-link") == 0 || strcmp(cmd, "set-rtt") == 0 ||
                strcmp(cmd, "set-link-bytes") == 0 ||
                strcmp(cmd, "set-client-speed") == 0 || strcmp(cmd, "set-compute-cache") == 0 ||
                strcmp(cmd, "set-compute-stages") == 0 || strcmp(cmd, "set-compute-file-ms") == 0;
    if (!known)
        return say("unknown command '%s'", cmd), fputs(usage_text, stderr), EXIT_USAGE;
    if (takes_value) {
        /* set-X VALUE [MOUNTPOINT] */
        if (n < 2)
            return say("%s needs a value", cmd), fputs(usage_text, stderr), EXIT_USAGE;
        if (n > 3)
            return say("too many arguments for %s", cmd), fputs(usage_text, stderr), EXIT_USAGE;
        if (strpbrk(words[1], " \t\r\n") || !*words[1])
            return say("%s: '%s' is not one word", cmd, words[1]), EXIT_USAGE;
        char mnt[PATH_MAX];
        int rc = find_mount(n == 3 ? words[2] : NULL, NULL, mnt);
        return rc ? rc : cmd_set(mnt, cmd, words[1]);
    }
    if (n > 2 + takes_path)
        return say("too many arguments for %s", cmd), fputs(usage_text, stderr), EXIT_USAGE;

    /* warm and evict take [PATH] [MOUNTPOINT]: a lone word is the mountpoint if it is one. */
    const char *path = NULL, *mount_arg = NULL;
    if (takes_path && n == 3) {
        path = words[1];
        mount_arg = words[2];
    } else if (n == 2) {
        if (takes_path && (strcmp(words[1], "all") == 0 || !has_config(words[1])))
            path = words[1];
        else
            mount_arg = words[1];
    }
    char mnt[PATH_MAX];
    int rc = find_mount(mount_arg, path && strcmp(path, "all") ? path : NULL, mnt);
    if (rc)
        return rc;

    char name[PATH_MAX] = "";
    if (path && strcmp(path, "all") != 0 && (rc = source_name(mnt, path, name, sizeof(name))))
        return rc;
    if (strcmp(cmd, "status") == 0)
        return cmd_status(mnt);
    if (strcmp(cmd, "errors") == 0)
        return cmd_errors(mnt);
    if (strcmp(cmd, "profile") == 0)
        return cmd_profile(mnt);
    if (strcmp(cmd, "policy") == 0)
        return cmd_policy(mnt);
    if (strcmp(cmd, "warm") == 0)
        return cmd_warm(mnt, name);
    if (strcmp(cmd, "evict") == 0)
        return cmd_evict(mnt, name);
    return cmd_show(mnt, cmd);
}
