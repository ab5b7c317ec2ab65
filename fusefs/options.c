/* options.c — the command line and -o options of hapifs and mount.hapifs, parsed and validated before anything loads. */
#include "options.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "policy.h"
#include "shared.h"

#include "policy.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <stddef.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HAPI_DEFAULT_CACHE_DIR "/var/cache/hapifs"
#define HAPI_DEFAULT_MAX_PIXELS 100000000ull
#define HAPI_DEFAULT_NODE_FILE "/run/hapifs/node"

/* Option values as written; validated into hapi_fs_options afterwards. */
struct raw_options {
    char *model, *split, *freeze, *dtype, *preprocess, *precision, *cache, *cache_size;
    char *threads, *torch_threads, *show_raw, *watch, *no_open, *uring, *max_pixels, *device, *log;
    char *batch, *batch_wait, *decode_threads, *inference_workers, *mem, *warm, *cache_reset;
    char *link, *link_bytes, *client_speed, *compute_file_ms, *epochs, *profile, *prefetch;
    char *refresh, *fetch_threads, *features, *rtt, *transport, *ctl_group;
    char *node, *node_mem, *node_cores;
    int remote;
    int allow_other, default_permissions; /* given among the kernel options */
    char *nonopt[3];
    int nonopts;
    int helper;
    int foreground, debug, fake, help, version;
    char *bad_option;
    char *kernel_opts;  /* kernel mount options to pass on, comma-separated */
};

enum { KEY_FOREGROUND, KEY_DEBUG, KEY_HELP, KEY_VERSION, KEY_HELPER_FLAG, KEY_IGNORE, KEY_FUSE };

#define RAW(t, field) { t, offsetof(struct raw_options, field), 0 }

static const struct fuse_opt option_table[] = {
    RAW("model=%s", model),
    RAW("split=%s", split),
    RAW("freeze=%s", freeze),
    RAW("dtype=%s", dtype),
    RAW("preprocess=%s", preprocess),
    RAW("precision=%s", precision),
    RAW("cache=%s", cache),
    RAW("cache_size=%s", cache_size),
    RAW("threads=%s", threads),
    RAW("torch_threads=%s", torch_threads),
    RAW("show_raw=%s", show_raw),
    RAW("watch=%s", watch),
    RAW("no_open=%s", no_open),
    RAW("uring=%s", uring),
    RAW("max_pixels=%s", max_pixels),
    RAW("device=%s", device),
    RAW("log=%s", log),
    RAW("batch=%s", batch),
    RAW("batch_wait=%s", batch_wait),
    RAW("decode_threads=%s", decode_threads),
    RAW("inference_workers=%s", inference_workers),
    RAW("mem=%s", mem),
    RAW("warm=%s", warm),
    RAW("prefetch=%s", prefetch),
    RAW("cache_reset=%s", cache_reset),
    RAW("link=%s", link),
    RAW("link_bytes=%s", link_bytes),
    RAW("client_speed=%s", client_speed),
    RAW("compute_file_ms=%s", compute_file_ms),
    RAW("epochs=%s", epochs),
    RAW("profile=%s", profile),
    RAW("refresh=%s", refresh),
    RAW("rtt=%s", rtt),
    RAW("transport=%s", transport),
    RAW("fetch_threads=%s", fetch_threads),
    RAW("features=%s", features),
    RAW("ctl_group=%s", ctl_group),
    RAW("node=%s", node),
    RAW("node_mem=%s", node_mem),
    RAW("node_cores=%s", node_cores),
    { "remote", offsetof(struct raw_options, remote), 1 },
    FUSE_OPT_KEY("-f", KEY_FOREGROUND),
    FUSE_OPT_KEY("-d", KEY_DEBUG),
    FUSE_OPT_KEY("debug", KEY_DEBUG),
    FUSE_OPT_KEY("-h", KEY_HELP),
    FUSE_OPT_KEY("--help", KEY_HELP),
    FUSE_OPT_KEY("-V", KEY_VERSION),
    FUSE_OPT_KEY("--version", KEY_VERSION),
    /* mount(8) calls helpers with -s (sloppy), -n (no mtab), -v (verbose). */
    FUSE_OPT_KEY("-s", KEY_HELPER_FLAG),
    FUSE_OPT_KEY("-n", KEY_HELPER_FLAG),
    FUSE_OPT_KEY("-v", KEY_HELPER_FLAG),
    /* Words meant for mount(8), fstab or systemd, not for us. */
    FUSE_OPT_KEY("rw", KEY_IGNORE),
    FUSE_OPT_KEY("ro", KEY_IGNORE),
    FUSE_OPT_KEY("defaults", KEY_IGNORE),
    FUSE_OPT_KEY("auto", KEY_IGNORE),
    FUSE_OPT_KEY("noauto", KEY_IGNORE),
    FUSE_OPT_KEY("user", KEY_IGNORE),
    FUSE_OPT_KEY("nouser", KEY_IGNORE),
    FUSE_OPT_KEY("users", KEY_IGNORE),
    FUSE_OPT_KEY("_netdev", KEY_IGNORE),
    FUSE_OPT_KEY("nofail", KEY_IGNORE),
    FUSE_OPT_KEY("comment=", KEY_IGNORE),
    FUSE_OPT_KEY("async", KEY_IGNORE),
    FUSE_OPT_KEY("relatime", KEY_IGNORE),
    FUSE_OPT_KEY("nodiratime", KEY_IGNORE),
    /* Kernel mount options that keep their meaning. */
    FUSE_OPT_KEY("allow_other", KEY_FUSE),
    FUSE_OPT_KEY("default_permissions", KEY_FUSE),
    FUSE_OPT_KEY("nosuid", KEY_FUSE),
    FUSE_OPT_KEY("suid", KEY_FUSE),
    FUSE_OPT_KEY("nodev", KEY_FUSE),
    FUSE_OPT_KEY("dev", KEY_FUSE),
    FUSE_OPT_KEY("noexec", KEY_FUSE),
    FUSE_OPT_KEY("exec", KEY_FUSE),
    FUSE_OPT_KEY("noatime", KEY_FUSE),
    FUSE_OPT_KEY("atime", KEY_FUSE),
    FUSE_OPT_END
};

static int option_proc(void *data, const char *arg, int key, struct fuse_args *outargs)
{
    struct raw_options *raw = data;
    (void)outargs;

    switch (key) {
    case FUSE_OPT_KEY_NONOPT:
        if (raw->nonopts >= 2) {
            if (!raw->bad_option)
                raw->bad_option = strdup(arg);
            return 0;
        }
        raw->nonopt[raw->nonopts++] = strdup(arg);
        return 0;
    case KEY_FOREGROUND:
        /* For a mount helper, -f is mount(8)'s "fake": do everything but mount. */
        if (raw->helper)
            raw->fake = 1;
        else
            raw->foreground = 1;
        return 0;
    case KEY_DEBUG:
        raw->debug = 1;
        raw->foreground = 1;
        return 0;
    case KEY_HELP:
        raw->help = 1;
        return 0;
    case KEY_VERSION:
        raw->version = 1;
        return 0;
    case KEY_HELPER_FLAG:
    case KEY_IGNORE:
        return 0;
    case KEY_FUSE:
        if (strcmp(arg, "allow_other") == 0)
            raw->allow_other = 1;
        if (strcmp(arg, "default_permissions") == 0)
            raw->default_permissions = 1;
        return fuse_opt_add_opt(&raw->kernel_opts, arg) < 0 ? -1 : 0;
    default:
        /* x-systemd.automount, x-gvfs-show, ...: for other programs. */
        if (strncmp(arg, "x-", 2) == 0)
            return 0;
        /* An option nobody knows: refuse it rather than mount something unexpected. */
        if (!raw->bad_option)
            raw->bad_option = strdup(arg);
        return 0;
    }
}

#define HELP_COLUMN 25 /* where an option's text starts */
#define HELP_WIDTH 92  /* where its lines end */

/* One option's lines of --help: "    HEAD  TEXT", TEXT's words wrapped under HELP_COLUMN. */
static void print_help_option(const char *head, const char *text)
{
    int col = printf("    %s  ", head);
    for (; col < HELP_COLUMN; col++)
        putchar(' ');
    for (const char *w = text; *w;) {
        size_t n = strcspn(w, " ");
        if (w != text && col + 1 + (int)n > HELP_WIDTH) {
            col = printf("\n%*s", HELP_COLUMN, "") - 1;
        } else if (w != text) {
            putchar(' ');
            col++;
        }
        col += printf("%.*s", (int)n, w);
        w += n;
        w += strspn(w, " ");
    }
    putchar('\n');
}

/*
 * The policy's inputs that are mount options, from their table (policy/inputs.c): each one's
 * value, meaning, range, unit and default as the table has them, so that --help, README.md's
 * table (tests/test_examples.py compares them) and the parser cannot drift.
 */
static void print_policy_inputs(void)
{
    size_t n;
    const hapi_policy_input_spec *specs = hapi_policy_input_specs(&n);
    for (size_t i = 0; i < n; i++) {
        char head[64], text[512];
        if (!specs[i].mount_option)
            continue;
        snprintf(head, sizeof(head), "%s=%s", specs[i].name, specs[i].value);
        hapi_policy_input_help(&specs[i], text, sizeof(text));
        print_help_option(head, text);
    }
}

void hapi_fs_usage(const char *prog)
{
    printf("usage: %s SOURCE MOUNTPOINT -o model=PATH[,OPTIONS] [-f] [-d]\n"
           "       %s SOURCE[:SOURCE...] MOUNTPOINT -o remote[,OPTIONS] [-f] [-d]\n"
           "\n"
           "Shows every image x.jpg under SOURCE as x.jpg.feat, a .npy array of the\n"
           "features a frozen model prefix computes from it, cached in LMDB.\n"
           "With remote (on a compute node), each SOURCE is where a storage node's hapifs\n"
           "mount is visible (sshfs, NFS, mergerfs): the mount shows the union of their\n"
           ".feat files and fetches each directory's features in bulk into a local cache.\n"
           "\n"
           "options:\n"
           "    model=PATH           staged model archive (hapifs-export-model); required\n"
           "    split=auto|N|NAME    run stages [0, N), N in 1..the frozen stages (freeze=), or\n"
           "                         through stage NAME (default auto: the policy picks it from\n"
           "                         the profile, the policy inputs below and the cache)\n"
           "    freeze=N|NAME        stages before this are frozen (default: from the model)\n"
           "    dtype=fp16|fp32      feature type (default fp16)\n"
           "    preprocess=exact|fast  torchvision-exact decode, or DCT-scaled decode (default exact)\n"
           "    precision=fp32|bf16|int8|auto  arithmetic of the model: fp32 (default), or bfloat16\n"
           "                         on the CPU, ~4x faster with AMX or AVX512-BF16 (cosine 0.9995\n"
           "                         or in fp32), or int8 on the CPU, calibrated on the source's\n"
           "                         first 32 images (cosine 0.995 or in fp32), or auto: the\n"
           "                         three timed at mount, the fastest kept (int8 calibrated\n"
           "                         to cosine 0.999 at the freeze point)\n"
           "    cache=DIR            feature cache directory (default " HAPI_DEFAULT_CACHE_DIR ")\n"
           "    cache_size=SIZE      bound on the cache, e.g. 20G (default: 1/4 of free space)\n"
           "    cache_reset=0|1      replace a corrupt or foreign cache instead of failing\n"
           "    threads=N            FUSE worker threads (default 32)\n"
           "    torch_threads=N      libtorch intra-op threads (default: cores)\n"
           "    batch=auto|N         storage-side batch, N in 1..%d (default auto: the fastest\n"
           "                         per sample measured that fits mem)\n"
           "    batch_wait=MS        how long a partial batch waits for more reads (default 5)\n"
           "    decode_threads=N     JPEG/PNG decode threads (default 1)\n"
           "    inference_workers=N  inference threads, each running its own batches with\n"
           "                         torch_threads/N threads (default 1)\n"
           "    mem=SIZE             storage-side memory budget: weights, inference, images in\n"
           "                         flight; a size above 0, e.g. 512M or 2G (default 1G)\n"
           "    node=PATH|none       the file the mounts of this node share their budget and\n"
           "                         cores through (default /run/hapifs/node)\n"
           "    node_mem=SIZE        the budget of all mounts of the node together (default:\n"
           "                         the node file's, first set to half the RAM)\n"
           "    node_cores=N         cores the node's inferences share (default: the node\n"
           "                         file's, first set to the online CPUs)\n"
           "    profile=redo         measure the model again instead of using the stored profile\n"
           "    warm=0|1             compute the whole tree in the background at mount\n"
           "    prefetch=dir|off     a miss queues the rest of its directory below every read\n"
           "                         (default dir; off while the tree would fill half the cache)\n"
           "    device=cpu|cuda[:N]  where the model runs (default cpu)\n"
           "    max_pixels=N         refuse larger images (default 100000000)\n"
           "    show_raw=0|1         also show the images themselves (default 0)\n"
           "    watch=0|1            watch the source with inotify: the kernel keeps names and\n"
           "                         listings 300 s and is told of changes (default 1); 0: 1 s\n"
           "    no_open=0|1          with watch=1, let the kernel read files without opening them\n"
           "                         in the daemon (default 1)\n"
           "    uring=0|1            serve requests through io_uring on the caller's CPU where the\n"
           "                         kernel offers it (fuse.enable_uring; default 1)\n"
           "    log=PATH             log to PATH (default: syslog, stderr with -f)\n"
           "    allow_other          let other users read the mount, as the source's own modes,\n"
           "                         owners and groups let them read the source (this turns on\n"
           "                         default_permissions; the daemon checks packs and errors)\n"
           "    ctl_group=GROUP      members may write .hapifs/ctl too (default: root and the\n"
           "                         mount's owner only)\n"
           "    default_permissions, nosuid, nodev, noexec: as for any FUSE mount\n"
           "    -f                   stay in the foreground\n"
           "    -d                   debug output (implies -f)\n"
           "    -h, -V               help, version\n"
           "\n"
           "policy inputs (storage side): what the policy assumes of the link and the compute\n"
           "tier; hapifs-ctl set-* changes them on a live mount, .hapifs/policy shows their use:\n",
           prog, prog, HAPI_BATCH_MAX);
    print_policy_inputs();
    printf("\n"
           "remote options (a compute-side mount; cache=, cache_size=, cache_reset=, threads=, uring=,\n"
           "log= and the FUSE options apply too):\n"
           "    remote               SOURCE[:SOURCE...] are storage mounts seen through a network\n"
           "                         filesystem; features are fetched as per-directory packs\n"
           "    refresh=SECONDS      a directory's index (names, identities, namespace) is read\n"
           "                         again after this long: the bound on serving features of a\n"
           "                         changed image or an old split (default 30, 0 = every use)\n"
           "    fetch_threads=N      packs fetched at once (default 2 a source, 4 at least)\n"
           "    features=freeze|split\n"
           "                         what a .feat is: the freeze point's, whatever the storage\n"
           "                         side's split (default; the stages [split, freeze) of the\n"
           "                         storage side's model run here, once per image), or the\n"
           "                         storage side's split's, as it sends them\n"
           "    precision=fp32|bf16, torch_threads=N\n"
           "                         with features=freeze: how those stages run here (default fp32;\n"
           "                         libtorch's threads)\n");
}

int hapi_fs_parse_size(const char *text, uint64_t *out)
{
    return hapi_policy_parse_size(text, out, NULL);
}

int hapi_fs_parse_time(const char *text, double *seconds)
{
    return hapi_policy_parse_time(text, seconds, NULL);
}

/* A word option: the choices (and their aliases) and the value each stands for. */
struct word_choice {
    const char *word;
    int value;
};

/*
 * Sets *out to the value of text among choices (count of them; NULL text keeps *out, the
 * default). Refuses anything else, naming the choices that are not aliases (expect).
 */
static int parse_word(const char *option, const char *text, const struct word_choice *choices,
                      size_t count, const char *expect, int *out, hapi_error *err)
{
    if (!text)
        return 0;
    for (size_t i = 0; i < count; i++) {
        if (strcmp(text, choices[i].word) == 0) {
            *out = choices[i].value;
            return 0;
        }
    }
    return hapi_error_set(err, HAPI_EINVAL, "%s=%s: expected %s", option, text, expect);
}

#define WORDS(a) a, sizeof(a) / sizeof(a[0])

static const struct word_choice dtype_words[] = {
    { "fp16", HAPI_DTYPE_FP16 }, { "float16", HAPI_DTYPE_FP16 },
    { "fp32", HAPI_DTYPE_FP32 }, { "float32", HAPI_DTYPE_FP32 },
};
static const struct word_choice preprocess_words[] = {
    { "exact", HAPI_PREPROCESS_EXACT }, { "fast", HAPI_PREPROCESS_FAST },
};
static const struct word_choice precision_words[] = {
    { "fp32", HAPI_PRECISION_FP32 }, { "float32", HAPI_PRECISION_FP32 },
    { "bf16", HAPI_PRECISION_BF16 }, { "bfloat16", HAPI_PRECISION_BF16 },
};
/* a storage mount's: int8 calibrates on its source's images, auto measures its own model */
static const struct word_choice storage_precision_words[] = {
    { "fp32", HAPI_PRECISION_FP32 }, { "float32", HAPI_PRECISION_FP32 },
    { "bf16", HAPI_PRECISION_BF16 }, { "bfloat16", HAPI_PRECISION_BF16 },
    { "int8", HAPI_PRECISION_INT8 }, { "auto", HAPI_PRECISION_AUTO },
};
static const struct word_choice prefetch_words[] = {
    { "dir", HAPI_PREFETCH_DIR }, { "off", HAPI_PREFETCH_OFF },
};

/* Parses a decimal integer in [lo, hi]. */
static int parse_int(const char *text, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi)
        return HAPI_EINVAL;
    *out = v;
    return 0;
}

/*
 * An integer option in [lo, hi] into *out; NULL text keeps *out (the default). The refusal
 * names the range, and its unit when one is given: "batch_wait=x: expected 0..10000 (ms)".
 */
static int parse_int_option(const char *option, const char *text, long lo, long hi,
                            const char *unit, int *out, hapi_error *err)
{
    long v;
    if (!text)
        return 0;
    if (parse_int(text, lo, hi, &v) < 0)
        return hapi_error_set(err, HAPI_EINVAL, "%s=%s: expected %ld..%ld%s%s%s", option, text,
                              lo, hi, unit ? " (" : "", unit ? unit : "", unit ? ")" : "");
    *out = (int)v;
    return 0;
}

/* A 0|1 option into *out; NULL text keeps *out (the default). */
static int parse_flag(const char *option, const char *text, int *out, hapi_error *err)
{
    long v;
    if (!text)
        return 0;
    if (parse_int(text, 0, 1, &v) < 0)
        return hapi_error_set(err, HAPI_EINVAL, "%s=%s: expected 0 or 1", option, text);
    *out = (int)v;
    return 0;
}

/* Resolves path and checks it is a directory; owned result in *out. */
static int resolve_dir(const char *what, const char *path, char **out, hapi_error *err)
{
    struct stat st;
    char *real = realpath(path, NULL);
    if (!real)
        return hapi_error_set(err, -errno, "%s %s: %s", what, path, strerror(errno));
    if (stat(real, &st) < 0 || !S_ISDIR(st.st_mode)) {
        free(real);
        return hapi_error_set(err, -ENOTDIR, "%s %s: not a directory", what, path);
    }
    *out = real;
    return 0;
}

/* Undoes /proc/mounts' octal escapes (\040 for a space...) in place. */
static void unescape_mount_field(char *s)
{
    char *out = s;
    for (; *s; s++) {
        if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' &&
            s[3] >= '0' && s[3] <= '7') {
            *out++ = (char)((s[1] - '0') * 64 + (s[2] - '0') * 8 + (s[3] - '0'));
            s += 3;
        } else {
            *out++ = *s;
        }
    }
    *out = '\0';
}

#define PROBE_NS (10ull * 1000 * 1000 * 1000) /* a mount that does not answer statfs in 10 s */

/*
 * statvfs(path) in a child, waited for at most PROBE_NS: 0 if it answered,
 * the errno it failed with, or ETIMEDOUT if nobody answers. A daemon killed
 * while its io_uring ring held requests can leave its FUSE connection alive
 * with nobody to answer it (the two-tier soak, AMD EPYC, kernel 6.18: a
 * compute daemon killed at 1,215 s of 1,800; its restart waited in this
 * statvfs for good, and every restart after it). The child, if still
 * waiting, is killed and reaped if it can be; a request already sent waits
 * unkillably until the old daemon's descriptor closes (an abort of the
 * connection did not end it, Linux 6.18 with io_uring): it is left, orphaned.
 */
static int probe_mount(const char *path)
{
    struct statvfs sv;
    pid_t pid = fork();
    if (pid < 0)
        return statvfs(path, &sv) == 0 ? 0 : errno;
    if (pid == 0) {
        /*
         * Not the caller's stdio: a child still waiting (its request may
         * wait until the old daemon's descriptor closes, abort or not) must
         * not hold the pipes whoever started us reads to their end.
         */
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        for (int fd = 0; null >= 0 && fd < 3; fd++)
            dup2(null, fd);
        _exit(statvfs(path, &sv) == 0 ? 0 : errno > 0 && errno < 256 ? errno : EIO);
    }
    uint64_t end = hapi_now_ns() + PROBE_NS;
    int status;
    for (;;) {
        pid_t got = waitpid(pid, &status, WNOHANG);
        if (got == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : EIO;
        if (got < 0 && errno != EINTR)
            return EIO;
        if (hapi_now_ns() > end)
            break;
        nanosleep(&(struct timespec){ .tv_nsec = 10000000L }, NULL);
    }
    kill(pid, SIGKILL);
    for (int i = 0; i < 100 && waitpid(pid, &status, WNOHANG) == 0; i++)
        nanosleep(&(struct timespec){ .tv_nsec = 10000000L }, NULL);
    return ETIMEDOUT;
}

/*
 * Whether path is a hapifs mount whose daemon died (the kernel answers
 * ENOTCONN, "Transport endpoint is not connected", ECONNABORTED, or for a few
 * tens of milliseconds ECANCELED while io_uring tears down the dead daemon's
 * ring, or nothing at all for PROBE_NS: see probe_mount()): then the daemon detaches it right before it mounts there
 * (hapi_fs_detach_dead_mount()), so that a restarted daemon (systemd's
 * Restart=, or an operator) mounts again without anyone having to unmount
 * first, and readers meanwhile hear that the daemon is gone, not that their
 * files are (the directory beneath). Mounts of other filesystems are left
 * alone. Returns 1 with its absolute path in abs (PATH_MAX), else 0.
 */
static int is_dead_mount(const char *path, char *abs)
{
    /*
     * statfs, not stat: the kernel may answer a stat from attributes it keeps
     * for a second; a statfs always asks the daemon.
     */
    int e = probe_mount(path);
    if (e != ENOTCONN && e != ECONNABORTED && e != ECANCELED && e != ETIMEDOUT)
        return 0;
    if (path[0] == '/')
        snprintf(abs, PATH_MAX, "%s", path);
    else if (getcwd(abs, PATH_MAX))
        snprintf(abs + strlen(abs), PATH_MAX - strlen(abs), "/%s", path);
    else
        return 0;
    size_t n = strlen(abs);
    while (n > 1 && abs[n - 1] == '/')
        abs[--n] = '\0';
    FILE *f = fopen("/proc/self/mounts", "re");
    if (!f)
        return 0;
    char line[2 * PATH_MAX + 256];
    int ours = 0;
    while (fgets(line, sizeof(line), f)) {
        char *save = NULL;
        char *src = strtok_r(line, " ", &save);
        char *mnt = strtok_r(NULL, " ", &save);
        char *type = strtok_r(NULL, " ", &save);
        if (!src || !mnt || !type)
            continue;
        unescape_mount_field(mnt);
        if (strcmp(mnt, abs) == 0)
            ours = strcmp(type, "fuse.hapifs") == 0; /* the last mount there decides */
    }
    fclose(f);
    if (ours && e == ETIMEDOUT)
        fprintf(stderr, "hapifs: %s did not answer in %llu s: its daemon is taken for dead\n",
                abs, (unsigned long long)(PROBE_NS / 1000000000ull));
    return ours;
}

#define FUSECTL "/sys/fs/fuse/connections"

/*
 * Aborts the FUSE connection of the last mount at abs (found by
 * /proc/self/mountinfo, not by a stat, which would wait for its daemon):
 * its requests still waiting end with ECONNABORTED. A daemon killed while
 * its io_uring ring held requests left the connection alive with nobody to
 * answer them (seen under the two-tier soak: 32 readers waiting for good
 * after the compute daemon's restart). Needs root (fusectl, mounted here if
 * it is not). Returns 0 or -errno.
 */
static int abort_connection(const char *abs)
{
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f)
        return -errno;
    char line[2 * PATH_MAX + 512];
    unsigned minor = 0;
    int found = 0;
    while (fgets(line, sizeof(line), f)) {
        char *save = NULL, *field[5] = { 0 };
        field[0] = strtok_r(line, " ", &save);
        for (int i = 1; i < 5 && field[i - 1]; i++)
            field[i] = strtok_r(NULL, " ", &save);
        if (!field[4])
            continue;
        unescape_mount_field(field[4]);
        unsigned maj, min;
        if (strcmp(field[4], abs) == 0 && sscanf(field[2], "%u:%u", &maj, &min) == 2) {
            minor = min;
            found = 1; /* the last one there is the top mount */
        }
    }
    fclose(f);
    if (!found)
        return -ENOENT;
    char path[128];
    snprintf(path, sizeof(path), FUSECTL "/%u/abort", minor);
    if (access(path, F_OK) < 0) {
        DIR *d = opendir(FUSECTL);
        int mounted = 0;
        for (struct dirent *e; d && (e = readdir(d));)
            mounted |= e->d_name[0] != '.';
        if (d)
            closedir(d);
        if (!mounted && mount("fusectl", FUSECTL, "fusectl", 0, NULL) < 0)
            return -errno;
        if (access(path, F_OK) < 0)
            return 0; /* the connection is gone: nothing waits on it */
    }
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = write(fd, "1", 1) == 1 ? 0 : -errno;
    close(fd);
    return rc;
}

void hapi_fs_abort_dead_mount(const hapi_fs_options *o)
{
    int rc = abort_connection(o->mountpoint);
    if (rc < 0 && rc != -EPERM && rc != -EACCES)
        hapi_log(HAPI_LOG_WARNING, "%s: cannot abort the dead mount's FUSE connection: %s",
                 o->mountpoint, strerror(-rc));
}

int hapi_fs_detach_dead_mount(const hapi_fs_options *o)
{
    const char *abs = o->mountpoint;
    int rc = umount2(abs, MNT_DETACH);
    if (rc < 0 && errno == EPERM) {
        /* not root: fusermount3 may undo a mount of ours */
        pid_t pid = fork();
        if (pid == 0) {
            execlp("fusermount3", "fusermount3", "-u", "-z", abs, (char *)NULL);
            _exit(127);
        }
        int status = 0;
        rc = pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
                     WEXITSTATUS(status) == 0
                 ? 0
                 : -1;
        errno = EPERM;
    }
    if (rc < 0)
        return -errno;
    if (!o->foreground || o->log_path) /* else the log is stderr */
        fprintf(stderr, "hapifs: %s was a hapifs mount whose daemon had died; detached it\n",
                abs);
    hapi_log(HAPI_LOG_INFO, "%s was a hapifs mount whose daemon had died; detached it", abs);
    return 0;
}

/*
 * Makes sure the cache directory exists and is writable; creates it with
 * its parents if missing.
 */
static int prepare_cache_dir(const char *path, char **out, hapi_error *err)
{
    struct stat st;
    struct statvfs sv;

    if (stat(path, &st) < 0) {
        if (errno != ENOENT)
            return hapi_error_set(err, -errno, "cache directory %s: %s", path, strerror(errno));
        /* with its parents, as mkdir -p: cache=/var/cache/hapifs/imagenet on a fresh node */
        char dir[PATH_MAX];
        if (snprintf(dir, sizeof(dir), "%s", path) >= (int)sizeof(dir))
            return hapi_error_set(err, -ENAMETOOLONG, "cache directory %s: too long", path);
        for (char *slash = strchr(dir + 1, '/');; slash = strchr(slash + 1, '/')) {
            if (slash)
                *slash = '\0';
            if (*dir && mkdir(dir, 0755) < 0 && errno != EEXIST)
                return hapi_error_set(err, -errno, "cache directory %s: cannot create %s: %s",
                                      path, dir, strerror(errno));
            if (!slash)
                break;
            *slash = '/';
        }
    } else if (!S_ISDIR(st.st_mode)) {
        return hapi_error_set(err, -ENOTDIR, "cache directory %s: not a directory", path);
    }
    if (statvfs(path, &sv) == 0 && (sv.f_flag & ST_RDONLY))
        return hapi_error_set(err, -EROFS, "cache directory %s: read-only file system", path);
    if (access(path, R_OK | W_OK | X_OK) < 0)
        return hapi_error_set(err, -errno, "cache directory %s: %s", path, strerror(errno));
    char *real = realpath(path, NULL);
    if (!real)
        return hapi_error_set(err, -errno, "cache directory %s: %s", path, strerror(errno));
    *out = real;
    return 0;
}

/* Default cache bound: a quarter of the free space, between 64 MiB and 256 GiB. */
static uint64_t default_cache_size(const char *dir)
{
    struct statvfs sv;
    uint64_t size = 1ull << 30;
    if (statvfs(dir, &sv) == 0)
        size = (uint64_t)sv.f_bavail * sv.f_frsize / 4;
    if (size < (64ull << 20))
        size = 64ull << 20;
    if (size > (256ull << 30))
        size = 256ull << 30;
    return size;
}

static int validate_common(struct raw_options *raw, hapi_fs_options *o, hapi_error *err);

/*
 * A compute-side mount: SOURCE is one or more directories joined by ':', each
 * resolved; the model and everything that computes features belong to the
 * storage side and are refused here, so a copied fstab line fails clearly.
 */
static int validate_remote(struct raw_options *raw, hapi_fs_options *o, hapi_error *err)
{
    const char *storage_only[][2] = {
        { "model", raw->model }, { "split", raw->split }, { "freeze", raw->freeze },
        { "dtype", raw->dtype }, { "preprocess", raw->preprocess },
        { "batch", raw->batch }, { "batch_wait", raw->batch_wait },
        { "decode_threads", raw->decode_threads },
        { "inference_workers", raw->inference_workers }, { "mem", raw->mem }, { "warm", raw->warm },
        { "node", raw->node }, { "node_mem", raw->node_mem }, { "node_cores", raw->node_cores },
        { "prefetch", raw->prefetch }, { "link", raw->link }, { "link_bytes", raw->link_bytes },
        { "client_speed", raw->client_speed }, { "compute_file_ms", raw->compute_file_ms },
        { "epochs", raw->epochs },
        { "profile", raw->profile }, { "device", raw->device }, { "max_pixels", raw->max_pixels },
        { "rtt", raw->rtt }, { "transport", raw->transport },
        { "show_raw", raw->show_raw }, { "watch", raw->watch },
        { "no_open", raw->no_open },
    };
    for (size_t i = 0; i < sizeof(storage_only) / sizeof(*storage_only); i++)
        if (storage_only[i][1])
            return hapi_error_set(err, HAPI_EINVAL, "%s= is an option of the storage side's "
                                  "mount, not of a remote one", storage_only[i][0]);
    int rc;
    o->remote = 1;
    char *list = strdup(raw->nonopt[0]), *save = NULL;
    if (!list)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    size_t n = 1;
    for (const char *p = list; *p; p++)
        n += *p == ':';
    o->roots = calloc(n, sizeof(*o->roots));
    rc = o->roots ? 0 : hapi_error_set(err, -ENOMEM, "out of memory");
    for (char *part = strtok_r(list, ":", &save); rc == 0 && part;
         part = strtok_r(NULL, ":", &save)) {
        char *dir = NULL;
        if ((rc = resolve_dir("source", part, &dir, err)) < 0)
            break;
        for (size_t i = 0; i < o->nroots; i++)
            if (strcmp(o->roots[i], dir) == 0)
                rc = hapi_error_set(err, HAPI_EINVAL, "source %s is given twice", dir);
        if (rc < 0) {
            free(dir);
            break;
        }
        o->roots[o->nroots++] = dir;
    }
    free(list);
    if (rc < 0)
        return rc;
    if (o->nroots == 0)
        return hapi_error_set(err, HAPI_EINVAL, "remote: no SOURCE directory given");
    /* The mount's name lists its sources: what df and /proc/mounts show. */
    size_t len = 1;
    for (size_t i = 0; i < o->nroots; i++)
        len += strlen(o->roots[i]) + 1;
    if (!(o->source = calloc(1, len)))
        return hapi_error_set(err, -ENOMEM, "out of memory");
    for (size_t i = 0; i < o->nroots; i++) {
        if (i)
            strcat(o->source, ":");
        strcat(o->source, o->roots[i]);
    }
    int refresh_s = 30;
    if ((rc = parse_int_option("refresh", raw->refresh, 0, 86400, "seconds", &refresh_s,
                               err)) < 0)
        return rc;
    o->refresh_ms = refresh_s * 1000;
    /* two a source (a node's next pack asked while it computes one), four at least */
    o->fetch_threads = o->nroots * 2 > 4 ? (int)(o->nroots * 2) : 4;
    if ((rc = parse_int_option("fetch_threads", raw->fetch_threads, 1, 256, NULL,
                               &o->fetch_threads, err)) < 0)
        return rc;
    if (raw->features && strcmp(raw->features, "split") != 0 &&
        strcmp(raw->features, "freeze") != 0)
        return hapi_error_set(err, HAPI_EINVAL, "features=%s: expected split or freeze",
                              raw->features);
    o->finish = !raw->features || strcmp(raw->features, "freeze") == 0;
    /* the stages run here, as on the storage side: in fp32 or bf16, on so many threads */
    o->precision = HAPI_PRECISION_FP32;
    o->torch_threads = 0;
    if (!o->finish && (raw->precision || raw->torch_threads))
        return hapi_error_set(err, HAPI_EINVAL, "%s= on a remote mount goes with features=freeze: "
                              "features=split runs no stage here",
                              raw->precision ? "precision" : "torch_threads");
    if ((rc = parse_word("precision", raw->precision, WORDS(precision_words), "fp32 or bf16",
                         &o->precision, err)) < 0 ||
        (rc = parse_int_option("torch_threads", raw->torch_threads, 1, 1024, NULL,
                               &o->torch_threads, err)) < 0)
        return rc;
    o->device = strdup("cpu");
    if (!o->device)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    return validate_common(raw, o, err);
}

/*
 * The model and how it runs: model= (an existing regular file), split=, freeze=, device=,
 * dtype=, preprocess=, precision=, prefetch=, and that bf16 runs on the CPU alone.
 */
static int validate_model(struct raw_options *raw, hapi_fs_options *o, hapi_error *err)
{
    int rc;
    if (!raw->model)
        return hapi_error_set(err, HAPI_EINVAL, "option model=PATH is required");
    o->model = realpath(raw->model, NULL);
    if (!o->model)
        return hapi_error_set(err, -errno, "model %s: %s", raw->model, strerror(errno));
    int fd = open(o->model, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return hapi_error_set(err, -errno, "model %s: %s", raw->model, strerror(errno));
    struct stat st;
    rc = fstat(fd, &st);
    close(fd);
    if (rc < 0 || !S_ISREG(st.st_mode))
        return hapi_error_set(err, HAPI_EINVAL, "model %s: not a regular file", raw->model);

    o->split = strdup(raw->split ? raw->split : "auto");
    o->freeze = raw->freeze ? strdup(raw->freeze) : NULL;
    o->device = strdup(raw->device ? raw->device : "cpu");
    if (!o->split || !o->device || (raw->freeze && !o->freeze))
        return hapi_error_set(err, -ENOMEM, "out of memory");
    if (!*o->split || (raw->freeze && !*o->freeze))
        return hapi_error_set(err, HAPI_EINVAL, "split= and freeze= need a stage number or name");
    if (strcmp(o->device, "cpu") != 0 && strncmp(o->device, "cuda", 4) != 0)
        return hapi_error_set(err, HAPI_EINVAL, "device=%s: expected cpu or cuda[:N]", o->device);

    o->dtype = HAPI_DTYPE_FP16;
    o->mode = HAPI_PREPROCESS_EXACT;
    o->precision = HAPI_PRECISION_FP32;
    o->prefetch = HAPI_PREFETCH_DIR;
    if ((rc = parse_word("dtype", raw->dtype, WORDS(dtype_words), "fp16 or fp32", &o->dtype,
                         err)) < 0 ||
        (rc = parse_word("preprocess", raw->preprocess, WORDS(preprocess_words), "exact or fast",
                         &o->mode, err)) < 0 ||
        (rc = parse_word("precision", raw->precision, WORDS(storage_precision_words),
                         "fp32, bf16, int8 or auto", &o->precision, err)) < 0 ||
        (rc = parse_word("prefetch", raw->prefetch, WORDS(prefetch_words), "dir or off",
                         &o->prefetch, err)) < 0)
        return rc;
    if ((o->precision == HAPI_PRECISION_BF16 || o->precision == HAPI_PRECISION_INT8) &&
        strcmp(o->device, "cpu") != 0)
        return hapi_error_set(err, HAPI_EINVAL, "precision=%s runs on the CPU only, not %s",
                              hapi_precision_name(o->precision), o->device);
    return 0;
}

/*
 * What the storage side spends: torch_threads=, batch=, batch_wait=, decode_threads=, mem=,
 * and the node's shared budget (node=, node_mem=, node_cores=).
 */
static int validate_resources(struct raw_options *raw, hapi_fs_options *o, hapi_error *err)
{
    long v;
    int rc;
    o->torch_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (o->torch_threads < 1)
        o->torch_threads = 1;
    if ((rc = parse_int_option("torch_threads", raw->torch_threads, 1, 1024, NULL,
                               &o->torch_threads, err)) < 0)
        return rc;
    o->batch = 0; /* auto: the policy sizes it */
    if (raw->batch && strcmp(raw->batch, "auto") != 0) {
        if (parse_int(raw->batch, 1, HAPI_BATCH_MAX, &v) < 0)
            return hapi_error_set(err, HAPI_EINVAL, "batch=%s: expected auto or 1..%d",
                                  raw->batch, HAPI_BATCH_MAX);
        o->batch = (int)v;
    }
    int batch_wait_ms = 5;
    if ((rc = parse_int_option("batch_wait", raw->batch_wait, 0, 10000, "ms", &batch_wait_ms,
                               err)) < 0)
        return rc;
    o->batch_wait_us = batch_wait_ms * 1000;
    o->decode_threads = 1;
    if ((rc = parse_int_option("decode_threads", raw->decode_threads, 1, 256, NULL,
                               &o->decode_threads, err)) < 0)
        return rc;
    o->inference_workers = 1;
    if ((rc = parse_int_option("inference_workers", raw->inference_workers, 1,
                               HAPI_BATCHER_WORKERS_MAX, NULL, &o->inference_workers, err)) < 0)
        return rc;
    o->mem_budget = 1ull << 30;
    if (raw->mem && (hapi_fs_parse_size(raw->mem, &o->mem_budget) < 0 || o->mem_budget == 0))
        return hapi_error_set(err, HAPI_EINVAL, "mem=%s: expected a size, e.g. 2G", raw->mem);
    o->node_path = strdup(raw->node ? raw->node : HAPI_DEFAULT_NODE_FILE);
    if (!o->node_path)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    if (strcmp(o->node_path, "none") == 0) {
        free(o->node_path);
        o->node_path = NULL;
    } else if (o->node_path[0] != '/') {
        return hapi_error_set(err, HAPI_EINVAL, "node=%s: expected an absolute path or none",
                              raw->node);
    }
    o->node_required = raw->node || raw->node_mem || raw->node_cores;
    if (raw->node_mem && (hapi_fs_parse_size(raw->node_mem, &o->node_mem) < 0 ||
                          o->node_mem == 0))
        return hapi_error_set(err, HAPI_EINVAL, "node_mem=%s: expected a size, e.g. 8G",
                              raw->node_mem);
    return parse_int_option("node_cores", raw->node_cores, 1, 4096, NULL, &o->node_cores, err);
}

/* The policy's inputs (link=, rtt=, ...): parsed and checked by its table, as ctl does. */
static int validate_policy_inputs(struct raw_options *raw, hapi_fs_options *o, hapi_error *err)
{
    int rc;
    o->link_bps = HAPI_POLICY_LINK_DEFAULT;
    o->transport = HAPI_TRANSPORT_FILE;
    o->client_speed = 1.0;
    o->compute_file_ms = -1; /* the policy's default, as compute_file_ms=default */
    o->link_bytes = HAPI_POLICY_LINK_BYTES_DEFAULT;
    o->epochs = HAPI_POLICY_EPOCHS_DEFAULT;
    const struct { const char *name, *text; double *number; int *whole; } inputs[] = {
        { "link", raw->link, &o->link_bps, NULL },
        { "link_bytes", raw->link_bytes, &o->link_bytes, NULL },
        { "rtt", raw->rtt, &o->rtt_s, NULL },
        { "transport", raw->transport, NULL, &o->transport },
        { "client_speed", raw->client_speed, &o->client_speed, NULL },
        { "compute_file_ms", raw->compute_file_ms, &o->compute_file_ms, NULL },
        { "epochs", raw->epochs, NULL, &o->epochs },
    };
    for (size_t i = 0; i < sizeof(inputs) / sizeof(*inputs); i++) {
        hapi_policy_input_value in;
        if (!inputs[i].text)
            continue;
        if ((rc = hapi_policy_input_parse(inputs[i].name, inputs[i].text, &in, err)) < 0)
            return rc;
        if (inputs[i].number)
            *inputs[i].number = in.number;
        else
            *inputs[i].whole = (int)in.number;
    }
    if (raw->profile) {
        if (strcmp(raw->profile, "redo") != 0)
            return hapi_error_set(err, HAPI_EINVAL, "profile=%s: expected redo", raw->profile);
        o->profile_redo = 1;
    }
    return 0;
}

/* What the mount shows and how the kernel reads it: warm=, show_raw=, watch=, no_open=,
   max_pixels=. */
static int validate_serving(struct raw_options *raw, hapi_fs_options *o, hapi_error *err)
{
    int rc;
    o->watch = 1;
    o->no_open = 1;
    if ((rc = parse_flag("warm", raw->warm, &o->warm, err)) < 0 ||
        (rc = parse_flag("show_raw", raw->show_raw, &o->show_raw, err)) < 0 ||
        (rc = parse_flag("watch", raw->watch, &o->watch, err)) < 0 ||
        (rc = parse_flag("no_open", raw->no_open, &o->no_open, err)) < 0)
        return rc;
    o->max_pixels = HAPI_DEFAULT_MAX_PIXELS;
    if (raw->max_pixels && (hapi_fs_parse_size(raw->max_pixels, &o->max_pixels) < 0 ||
                            o->max_pixels == 0))
        return hapi_error_set(err, HAPI_EINVAL, "max_pixels=%s: expected a positive number",
                              raw->max_pixels);
    return 0;
}

/*
 * The options as written into o, checked in this order: the command line's words, the mount
 * point (a dead mount of ours is taken as it is), then a remote mount's options or a storage
 * mount's source, model, resources, policy inputs and serving, then what both kinds take.
 */
static int validate(struct raw_options *raw, hapi_fs_options *o, hapi_error *err)
{
    int rc;

    if (raw->bad_option)
        return hapi_error_set(err, HAPI_EINVAL, "unknown option or argument '%s'", raw->bad_option);
    if (raw->nonopts < 2)
        return hapi_error_set(err, HAPI_EINVAL, "usage: hapifs SOURCE MOUNTPOINT -o model=PATH[,...]");
    char dead[PATH_MAX];
    if (!raw->fake && is_dead_mount(raw->nonopt[1], dead)) { /* mount -f: nothing to mount */
        /* detached right before the mount: its directory cannot be looked at until then */
        if (!(o->mountpoint = strdup(dead)))
            return hapi_error_set(err, -ENOMEM, "out of memory");
        o->dead_mount = 1;
    } else if ((rc = resolve_dir("mount point", raw->nonopt[1], &o->mountpoint, err)) < 0) {
        return rc;
    }
    if (raw->remote)
        return validate_remote(raw, o, err);
    if (raw->refresh || raw->fetch_threads || raw->features)
        return hapi_error_set(err, HAPI_EINVAL, "%s= is an option of a remote mount (-o remote)",
                              raw->refresh ? "refresh" : raw->fetch_threads ? "fetch_threads"
                                                                           : "features");
    if ((rc = resolve_dir("source", raw->nonopt[0], &o->source, err)) < 0 ||
        (rc = validate_model(raw, o, err)) < 0 ||
        (rc = validate_resources(raw, o, err)) < 0 ||
        (rc = validate_policy_inputs(raw, o, err)) < 0 ||
        (rc = validate_serving(raw, o, err)) < 0)
        return rc;
    return validate_common(raw, o, err);
}

/* What both kinds of mount take: the cache, its bound, the log. */
static int validate_common(struct raw_options *raw, hapi_fs_options *o, hapi_error *err)
{
    int rc;
    long v;
    o->threads = 32;
    o->uring = 1;
    if ((rc = parse_int_option("threads", raw->threads, 1, 1024, NULL, &o->threads, err)) < 0 ||
        (rc = parse_flag("uring", raw->uring, &o->uring, err)) < 0 ||
        (rc = parse_flag("cache_reset", raw->cache_reset, &o->cache_reset, err)) < 0)
        return rc;
    const char *cache = raw->cache ? raw->cache : HAPI_DEFAULT_CACHE_DIR;
    if ((rc = prepare_cache_dir(cache, &o->cache_dir, err)) < 0)
        return rc;
    if (raw->cache_size) {
        if (hapi_fs_parse_size(raw->cache_size, &o->cache_size) < 0 ||
            o->cache_size < (1ull << 20))
            return hapi_error_set(err, HAPI_EINVAL,
                                  "cache_size=%s: expected a size of at least 1M, e.g. 20G",
                                  raw->cache_size);
    } else {
        o->cache_size = default_cache_size(o->cache_dir);
    }
    o->ctl_gid = (gid_t)-1;
    if (raw->ctl_group) {
        /* a name, or a number that names no group by that name */
        char buf[4096];
        struct group gr, *found = NULL;
        if (getgrnam_r(raw->ctl_group, &gr, buf, sizeof(buf), &found) == 0 && found)
            o->ctl_gid = found->gr_gid;
        else if (parse_int(raw->ctl_group, 0, INT_MAX, &v) == 0)
            o->ctl_gid = (gid_t)v;
        else
            return hapi_error_set(err, HAPI_EINVAL, "ctl_group=%s: no such group",
                                  raw->ctl_group);
    }
    if (raw->log) {
        o->log_path = strdup(raw->log);
        if (!o->log_path)
            return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    return 0;
}

int hapi_fs_options_parse(int argc, char **argv, int helper, hapi_fs_options *o,
                          hapi_error *err)
{
    struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
    struct raw_options raw = { 0 };
    char *mount_opts = NULL;
    char *fsname = NULL;
    int rc;

    memset(o, 0, sizeof(*o));
    raw.helper = helper;
    if (fuse_opt_parse(&args, &raw, option_table, option_proc) < 0) {
        rc = hapi_error_set(err, HAPI_EINVAL, "cannot parse the command line");
        goto out;
    }
    o->foreground = raw.foreground;
    o->debug = raw.debug;
    o->fake = raw.fake;
    o->show_help = raw.help;
    o->show_version = raw.version;
    if (raw.help || raw.version) {
        rc = 0;
        goto out;
    }
    if ((rc = validate(&raw, o, err)) < 0)
        goto out;

    /*
     * What libfuse gets: a mount named after its source (commas escaped). Not
     * MS_RDONLY: .hapifs/ctl takes writes; the daemon refuses all others.
     */
    if (asprintf(&fsname, "fsname=%s", o->source) < 0) {
        fsname = NULL;
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    struct fuse_args *fa = &o->fuse_args;
    if (fuse_opt_add_opt(&mount_opts, "subtype=hapifs") < 0 ||
        fuse_opt_add_opt_escaped(&mount_opts, fsname) < 0 ||
        (raw.kernel_opts && fuse_opt_add_opt(&mount_opts, raw.kernel_opts) < 0) ||
        /* other users read as the source's modes let them: the kernel checks those */
        (raw.allow_other && !raw.default_permissions &&
         fuse_opt_add_opt(&mount_opts, "default_permissions") < 0) ||
        fuse_opt_add_arg(fa, argv[0]) < 0 || fuse_opt_add_arg(fa, "-o") < 0 ||
        fuse_opt_add_arg(fa, mount_opts) < 0 || (o->debug && fuse_opt_add_arg(fa, "-d") < 0)) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    rc = 0;
out:
    free(fsname);
    free(mount_opts);
    fuse_opt_free_args(&args);
    free(raw.model);
    free(raw.split);
    free(raw.freeze);
    free(raw.dtype);
    free(raw.preprocess);
    free(raw.precision);
    free(raw.cache);
    free(raw.cache_size);
    free(raw.threads);
    free(raw.torch_threads);
    free(raw.show_raw);
    free(raw.watch);
    free(raw.no_open);
    free(raw.uring);
    free(raw.max_pixels);
    free(raw.device);
    free(raw.log);
    free(raw.batch);
    free(raw.batch_wait);
    free(raw.decode_threads);
    free(raw.inference_workers);
    free(raw.mem);
    free(raw.warm);
    free(raw.prefetch);
    free(raw.link);
    free(raw.link_bytes);
    free(raw.client_speed);
    free(raw.compute_file_ms);
    free(raw.epochs);
    free(raw.profile);
    free(raw.cache_reset);
    free(raw.refresh);
    free(raw.rtt);
    free(raw.transport);
    free(raw.fetch_threads);
    free(raw.features);
    free(raw.ctl_group);
    free(raw.node);
    free(raw.node_mem);
    free(raw.node_cores);
    free(raw.bad_option);
    free(raw.kernel_opts);
    for (int i = 0; i < raw.nonopts; i++)
        free(raw.nonopt[i]);
    return rc;
}

void hapi_fs_options_free(hapi_fs_options *o)
{
    free(o->source);
    free(o->mountpoint);
    free(o->model);
    free(o->split);
    free(o->freeze);
    free(o->cache_dir);
    free(o->log_path);
    free(o->device);
    free(o->node_path);
    for (size_t i = 0; i < o->nroots; i++)
        free(o->roots[i]);
    free(o->roots);
    fuse_opt_free_args(&o->fuse_args);
    memset(o, 0, sizeof(*o));
}
