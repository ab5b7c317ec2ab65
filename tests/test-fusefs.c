/* test-fusefs.c — unit tests of the daemon's option parsing and error ring. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "options.h"
#include "policy.h"
#include "shared.h"
#include "source.h"
#include "warmup.h"

static char tmp[] = "/tmp/hapi-test-fusefs-XXXXXX";
static char src[512], mnt[512], model[512], cache[512];

static void setup(void)
{
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        exit(EXIT_FAILURE);
    }
    snprintf(src, sizeof(src), "%s/src", tmp);
    snprintf(mnt, sizeof(mnt), "%s/mnt", tmp);
    snprintf(model, sizeof(model), "%s/model.pt", tmp);
    snprintf(cache, sizeof(cache), "%s/cache", tmp);
    int fd = -1;
    if (mkdir(src, 0755) < 0 || mkdir(mnt, 0755) < 0 ||
        (fd = open(model, O_CREAT | O_WRONLY, 0644)) < 0) {
        perror(tmp);
        exit(EXIT_FAILURE);
    }
    close(fd);
}

/* Parses "hapifs SRC MNT -o <opts>" and returns the code; err gets the message. */
static int parse(const char *opts, hapi_fs_options *o, hapi_error *err)
{
    char *argv[] = { "hapifs", src, mnt, "-o", (char *)opts, NULL };
    return hapi_fs_options_parse(5, argv, 0, o, err);
}

static char *with_base(const char *fmt)
{
    static char buf[2048];
    snprintf(buf, sizeof(buf), fmt, model, cache);
    return buf;
}

START_TEST(test_options_defaults)
{
    hapi_fs_options o;
    hapi_error err = { 0 };
    ck_assert_int_eq(parse(with_base("model=%s,cache=%s"), &o, &err), 0);
    ck_assert_str_eq(o.split, "auto");
    ck_assert_ptr_null(o.freeze);
    ck_assert_int_eq(o.dtype, HAPI_DTYPE_FP16);
    ck_assert_int_eq(o.mode, HAPI_PREPROCESS_EXACT);
    ck_assert_int_eq(o.max_pixels, 100000000);
    ck_assert_int_eq(o.show_raw, 0);
    ck_assert_int_gt(o.cache_size, 0);
    ck_assert_str_eq(o.cache_dir, cache);
    /* the policy's inputs not given are their table's fallbacks, which --help states */
    const struct { const char *name; double got; } inputs[] = {
        { "link", o.link_bps }, { "rtt", o.rtt_s }, { "transport", o.transport },
        { "client_speed", o.client_speed }, { "epochs", o.epochs },
    };
    for (size_t i = 0; i < sizeof(inputs) / sizeof(*inputs); i++) {
        hapi_policy_input_value v;
        ck_assert_int_eq(hapi_policy_input_parse(inputs[i].name,
                                                 hapi_policy_input_find(inputs[i].name)->fallback,
                                                 &v, &err), 0);
        ck_assert_double_eq(inputs[i].got, v.number);
    }
    ck_assert_double_eq(o.compute_file_ms, -1); /* "default": the policy's, the fallback */
    /* the cache directory was created */
    struct stat st;
    ck_assert_int_eq(stat(cache, &st), 0);
    ck_assert(S_ISDIR(st.st_mode));
    /* libfuse gets a read-only mount named after the source */
    int seen = 0;
    for (int i = 0; i < o.fuse_args.argc; i++)
        if (strstr(o.fuse_args.argv[i], "subtype=hapifs,fsname=") == o.fuse_args.argv[i])
            seen = 1;
    ck_assert(seen);
    hapi_fs_options_free(&o);
}
END_TEST

START_TEST(test_options_values)
{
    hapi_fs_options o;
    hapi_error err = { 0 };
    ck_assert_int_eq(parse(with_base("model=%s,cache=%s,split=layer3,freeze=5,dtype=fp32,"
                                     "preprocess=fast,threads=7,show_raw=1,max_pixels=5M,"
                                     "cache_size=2G,allow_other,_netdev,nofail,noauto,rw,"
                                     "x-systemd.automount"),
                           &o, &err),
                     0);
    ck_assert_str_eq(o.split, "layer3");
    ck_assert_str_eq(o.freeze, "5");
    ck_assert_int_eq(o.dtype, HAPI_DTYPE_FP32);
    ck_assert_int_eq(o.mode, HAPI_PREPROCESS_FAST);
    ck_assert_int_eq(o.threads, 7);
    ck_assert_int_eq(o.show_raw, 1);
    ck_assert_int_eq(o.max_pixels, 5ull << 20);
    ck_assert_int_eq(o.cache_size, 2ull << 30);
    int allow_other = 0;
    for (int i = 0; i < o.fuse_args.argc; i++)
        if (strstr(o.fuse_args.argv[i], "allow_other"))
            allow_other = 1;
    ck_assert(allow_other);
    hapi_fs_options_free(&o);
}
END_TEST

/* The kernel options as libfuse gets them ("-o a,b,c"). */
static const char *kernel_opts(const hapi_fs_options *o)
{
    for (int i = 1; i < o->fuse_args.argc; i++)
        if (strcmp(o->fuse_args.argv[i - 1], "-o") == 0)
            return o->fuse_args.argv[i];
    return "";
}

/* allow_other turns default_permissions on; ctl_group= takes a group name or number. */
START_TEST(test_options_sharing)
{
    hapi_fs_options o;
    hapi_error err = { 0 };
    ck_assert_int_eq(parse(with_base("model=%s,cache=%s"), &o, &err), 0);
    ck_assert_ptr_null(strstr(kernel_opts(&o), "default_permissions"));
    ck_assert_int_eq(o.ctl_gid, (gid_t)-1);
    hapi_fs_options_free(&o);
    ck_assert_int_eq(parse(with_base("model=%s,cache=%s,allow_other,ctl_group=root"), &o, &err), 0);
    ck_assert_ptr_nonnull(strstr(kernel_opts(&o), "allow_other"));
    ck_assert_ptr_nonnull(strstr(kernel_opts(&o), "default_permissions"));
    ck_assert_int_eq(o.ctl_gid, 0);
    hapi_fs_options_free(&o);
    /* written by the operator too: once */
    ck_assert_int_eq(parse(with_base("model=%s,cache=%s,allow_other,default_permissions,"
                                     "ctl_group=4321"), &o, &err), 0);
    const char *k = kernel_opts(&o);
    ck_assert_ptr_null(strstr(strstr(k, "default_permissions") + 1, "default_permissions"));
    ck_assert_int_eq(o.ctl_gid, 4321);
    hapi_fs_options_free(&o);
    ck_assert_int_eq(parse(with_base("model=%s,cache=%s,ctl_group=no-such-group-x"), &o, &err),
                     HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "ctl_group=no-such-group-x: no such group"));
    hapi_fs_options_free(&o);
}
END_TEST

/* The mode-bit check the kernel makes: owner, then group, then others; root reads all. */
START_TEST(test_cred_may)
{
    hapi_cred u = { .uid = 1000, .gid = 100, .ngroups = 1, .groups = { 200 } };
    struct stat st = { .st_mode = S_IFREG | 0640, .st_uid = 1000, .st_gid = 5 };
    ck_assert(hapi_cred_may(&u, &st, R_OK));
    st.st_uid = 1;
    ck_assert(!hapi_cred_may(&u, &st, R_OK));
    st.st_gid = 200; /* a supplementary group */
    ck_assert(hapi_cred_may(&u, &st, R_OK));
    st.st_mode = S_IFREG | 0604; /* the group's bits rule a member, even when others may */
    ck_assert(!hapi_cred_may(&u, &st, R_OK));
    st.st_gid = 7;
    ck_assert(hapi_cred_may(&u, &st, R_OK));
    st.st_mode = S_IFDIR | 0744; /* read but not search */
    ck_assert(hapi_cred_may(&u, &st, R_OK));
    ck_assert(!hapi_cred_may(&u, &st, R_OK | X_OK));
    hapi_cred root = { 0 };
    st.st_mode = S_IFREG | 0000;
    ck_assert(hapi_cred_may(&root, &st, R_OK));
    ck_assert(!hapi_cred_may(&root, &st, X_OK));
    ck_assert(hapi_cred_may(NULL, &st, R_OK | X_OK));
}
END_TEST

/* The groups read from /proc are those the process has. */
START_TEST(test_cred_read_groups)
{
    gid_t want[256], got[256];
    int n = getgroups(256, want);
    ck_assert_int_ge(n, 0);
    ck_assert_int_eq(hapi_cred_read_groups(getpid(), got, 256), n);
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(got[i], want[i]);
    ck_assert_int_eq(hapi_cred_read_groups(getpid(), got, 0), n); /* counted beyond max */
    ck_assert_int_lt(hapi_cred_read_groups(999999999, got, 256), 0);
}
END_TEST

/* A path's name is seen through search on every folder above it and read on its own. */
START_TEST(test_source_may_see)
{
    char dir[600], sub[700];
    snprintf(dir, sizeof(dir), "%s/see", src);
    snprintf(sub, sizeof(sub), "%s/see/in", src);
    ck_assert_int_eq(mkdir(dir, 0711), 0);
    ck_assert_int_eq(mkdir(sub, 0755), 0);
    ck_assert_int_eq(chmod(src, 0755), 0);
    hapi_source *s;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_source_open(src, &s, &err), 0);
    hapi_cred u = { .uid = 4242, .gid = 4242 };
    ck_assert(hapi_source_may_see(s, &u, ""));
    ck_assert(hapi_source_may_see(s, &u, "see"));         /* src is readable */
    ck_assert(!hapi_source_may_see(s, &u, "see/in"));     /* see/ can be searched, not read */
    ck_assert(hapi_source_may_see(s, &u, "see/in/x.jpg")); /* in/ is readable, see/ searchable */
    ck_assert(!hapi_source_may_see(s, &u, "see/none/x.jpg"));
    ck_assert(hapi_source_may_see(s, NULL, "see/in"));
    ck_assert_int_eq(chmod(dir, 0700), 0);
    ck_assert(!hapi_source_may_see(s, &u, "see/in/x.jpg"));
    hapi_source_close(s);
}
END_TEST

/* Each bad option fails with a message that names it. */
/* batch= takes the range the ctl command and the batcher take. */
START_TEST(test_options_batch_range)
{
    hapi_fs_options o;
    hapi_error err = { 0 };
    ck_assert_int_eq(parse(with_base("model=%s,cache=%s,batch=4096"), &o, &err), 0);
    ck_assert_int_eq(o.batch, HAPI_BATCH_MAX);
    hapi_fs_options_free(&o);
}
END_TEST

START_TEST(test_options_errors)
{
    static const struct {
        const char *opts;
        const char *needle;
    } cases[] = {
        { "model=%s,cache=%s,dtype=int8", "dtype=int8" },
        { "model=%s,cache=%s,preprocess=slow", "preprocess=slow" },
        { "model=%s,cache=%s,threads=0", "threads=0" },
        { "model=%s,cache=%s,threads=lots", "threads=lots" },
        { "model=%s,cache=%s,show_raw=2", "show_raw=2" },
        { "model=%s,cache=%s,cache_size=huge", "cache_size=huge" },
        { "model=%s,cache=%s,max_pixels=-3", "max_pixels=-3" },
        { "model=%s,cache=%s,bogus=1", "bogus=1" },
        { "model=%s,cache=%s,device=tpu", "device=tpu" },
        { "model=%s,cache=%s,split=", "split=" },
        { "model=%s,cache=%s,batch=0", "batch=0: expected auto or 1..4096" },
        { "model=%s,cache=%s,batch=4097", "batch=4097" },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        hapi_fs_options o;
        hapi_error err = { 0 };
        int rc = parse(with_base(cases[i].opts), &o, &err);
        ck_assert_msg(rc < 0, "%s accepted", cases[i].opts);
        ck_assert_msg(strstr(err.message, cases[i].needle), "%s: message '%s'", cases[i].opts,
                      err.message);
        hapi_fs_options_free(&o);
    }
}
END_TEST

START_TEST(test_options_paths)
{
    hapi_fs_options o;
    hapi_error err = { 0 };
    char opts[2048];

    ck_assert_int_lt(parse("cache=/tmp", &o, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.message, "model=PATH is required"));
    hapi_fs_options_free(&o);

    snprintf(opts, sizeof(opts), "model=%s/missing.pt", tmp);
    ck_assert_int_eq(parse(opts, &o, &err), -ENOENT);
    ck_assert_ptr_nonnull(strstr(err.message, "missing.pt"));
    hapi_fs_options_free(&o);

    /* a cache "directory" that is a file */
    snprintf(opts, sizeof(opts), "model=%s,cache=%s", model, model);
    ck_assert_int_eq(parse(opts, &o, &err), -ENOTDIR);
    ck_assert_ptr_nonnull(strstr(err.message, "not a directory"));
    hapi_fs_options_free(&o);

    /* a cache directory whose parent does not exist: made with its parents */
    snprintf(opts, sizeof(opts), "model=%s,cache=%s/no/such", model, tmp);
    ck_assert_int_eq(parse(opts, &o, &err), 0);
    hapi_fs_options_free(&o);
    char made[PATH_MAX];
    snprintf(made, sizeof(made), "%s/no/such", tmp);
    struct stat mst;
    ck_assert_int_eq(stat(made, &mst), 0);
    ck_assert(S_ISDIR(mst.st_mode));
    rmdir(made);
    snprintf(made, sizeof(made), "%s/no", tmp);
    rmdir(made);

    /* ... unless a parent is a file */
    snprintf(opts, sizeof(opts), "model=%s,cache=%s/sub", model, model);
    ck_assert_int_eq(parse(opts, &o, &err), -ENOTDIR);
    ck_assert_ptr_nonnull(strstr(err.message, "Not a directory"));
    hapi_fs_options_free(&o);

    /* a source that is not a directory */
    char *argv[] = { "hapifs", model, mnt, "-o", opts, NULL };
    snprintf(opts, sizeof(opts), "model=%s,cache=%s", model, cache);
    ck_assert_int_eq(hapi_fs_options_parse(5, argv, 0, &o, &err), -ENOTDIR);
    ck_assert_ptr_nonnull(strstr(err.message, "source"));
    hapi_fs_options_free(&o);
}
END_TEST

/* As a mount helper, -f means "fake" (mount -f) and -s -n -v are accepted. */
START_TEST(test_options_helper)
{
    hapi_fs_options o;
    hapi_error err = { 0 };
    char opts[2048];
    snprintf(opts, sizeof(opts), "rw,model=%s,cache=%s", model, cache);
    char *argv[] = { "mount.hapifs", src, mnt, "-n", "-s", "-v", "-f", "-o", opts, NULL };
    ck_assert_int_eq(hapi_fs_options_parse(9, argv, 1, &o, &err), 0);
    ck_assert_int_eq(o.fake, 1);
    ck_assert_int_eq(o.foreground, 0);
    hapi_fs_options_free(&o);
    char *argv2[] = { "hapifs", src, mnt, "-f", "-o", opts, NULL };
    ck_assert_int_eq(hapi_fs_options_parse(6, argv2, 0, &o, &err), 0);
    ck_assert_int_eq(o.fake, 0);
    ck_assert_int_eq(o.foreground, 1);
    hapi_fs_options_free(&o);
}
END_TEST

START_TEST(test_parse_size)
{
    uint64_t v;
    ck_assert_int_eq(hapi_fs_parse_size("123", &v), 0);
    ck_assert_int_eq(v, 123);
    ck_assert_int_eq(hapi_fs_parse_size("64K", &v), 0);
    ck_assert_int_eq(v, 65536);
    ck_assert_int_eq(hapi_fs_parse_size("1.5G", &v), 0);
    ck_assert_int_eq(v, 3ull << 29);
    ck_assert_int_eq(hapi_fs_parse_size("2GiB", &v), 0);
    ck_assert_int_eq(v, 2ull << 30);
    ck_assert_int_eq(hapi_fs_parse_size("512MB", &v), 0);
    ck_assert_int_eq(v, 512ull << 20);
    ck_assert_int_eq(hapi_fs_parse_size("", &v), HAPI_EINVAL);
    ck_assert_int_eq(hapi_fs_parse_size("G", &v), HAPI_EINVAL);
    ck_assert_int_eq(hapi_fs_parse_size("10X", &v), HAPI_EINVAL);
    ck_assert_int_eq(hapi_fs_parse_size("-1", &v), HAPI_EINVAL);
}
END_TEST

START_TEST(test_parse_time)
{
    double s;
    ck_assert_int_eq(hapi_fs_parse_time("1ms", &s), 0);
    ck_assert_double_eq_tol(s, 1e-3, 1e-15);
    ck_assert_int_eq(hapi_fs_parse_time("500us", &s), 0);
    ck_assert_double_eq_tol(s, 5e-4, 1e-15);
    ck_assert_int_eq(hapi_fs_parse_time("2", &s), 0); /* ms, as ping prints it */
    ck_assert_double_eq_tol(s, 2e-3, 1e-15);
    ck_assert_int_eq(hapi_fs_parse_time("0.25s", &s), 0);
    ck_assert_double_eq_tol(s, 0.25, 1e-15);
    ck_assert_int_eq(hapi_fs_parse_time("0", &s), 0);
    ck_assert(s == 0);
    ck_assert_int_eq(hapi_fs_parse_time("", &s), HAPI_EINVAL);
    ck_assert_int_eq(hapi_fs_parse_time("-1ms", &s), HAPI_EINVAL);
    ck_assert_int_eq(hapi_fs_parse_time("1h", &s), HAPI_EINVAL);
    ck_assert_int_eq(hapi_fs_parse_time("ms", &s), HAPI_EINVAL);
}
END_TEST

START_TEST(test_error_ring)
{
    hapi_error_ring *r = hapi_error_ring_new();
    ck_assert_ptr_nonnull(r);
    for (int i = 0; i < HAPI_ERRORS_KEPT + 10; i++) {
        char path[32];
        snprintf(path, sizeof(path), "img%d.jpg", i);
        hapi_error_ring_add(r, path, HAPI_EDECODE, "truncated");
    }
    /* the same failure again at once is a repeat, not a new error */
    hapi_error_ring_add(r, "img265.jpg", HAPI_EDECODE, "truncated");
    char *json = hapi_error_ring_json(r, NULL, NULL);
    ck_assert_ptr_nonnull(json);
    ck_assert_ptr_nonnull(strstr(json, "\"repeats\": 1"));
    ck_assert_ptr_nonnull(strstr(json, "\"count\": 266"));
    ck_assert_ptr_null(strstr(json, "\"img9.jpg\""));     /* pushed out */
    ck_assert_ptr_nonnull(strstr(json, "\"img265.jpg\"")); /* newest kept */
    free(json);
    hapi_error_ring_free(r);
}
END_TEST

static int shown_if_public(const char *path, void *arg)
{
    (void)arg;
    return strncmp(path, "public/", 7) == 0;
}

/* With a filter, the errors of other paths are counted as hidden, not listed. */
START_TEST(test_error_ring_filter)
{
    hapi_error_ring *r = hapi_error_ring_new();
    hapi_error_ring_add(r, "public/a.jpg", HAPI_EDECODE, "truncated");
    hapi_error_ring_add(r, "private/b.jpg", HAPI_EDECODE, "truncated");
    hapi_error_ring_add(r, "private/c.jpg", HAPI_EDECODE, "truncated");
    char *json = hapi_error_ring_json(r, shown_if_public, NULL);
    ck_assert_ptr_nonnull(strstr(json, "\"public/a.jpg\""));
    ck_assert_ptr_null(strstr(json, "private"));
    ck_assert_ptr_nonnull(strstr(json, "\"hidden\": 2"));
    ck_assert_ptr_nonnull(strstr(json, "\"count\": 3"));
    free(json);
    json = hapi_error_ring_json(r, NULL, NULL);
    ck_assert_ptr_nonnull(strstr(json, "private/c.jpg"));
    ck_assert_ptr_null(strstr(json, "hidden"));
    free(json);
    hapi_error_ring_free(r);
}
END_TEST

static int shown_if_latin1(const char *path, void *arg)
{
    (void)arg;
    return strcmp(path, "public/caf\xe9.jpg") == 0; /* the path as recorded, not as shown */
}

/*
 * A path or message that is not UTF-8 (a Latin-1 file name) is listed, its bytes that are not
 * UTF-8 as \xNN (jansson refuses the string: the error was missing from the list).
 */
START_TEST(test_error_ring_not_utf8)
{
    hapi_error_ring *r = hapi_error_ring_new();
    hapi_error_ring_add(r, "public/caf\xe9.jpg", HAPI_EDECODE, "public/caf\xe9.jpg: truncated");
    hapi_error_ring_add(r, "public/d\xc3\xa9j\xc3\xa0.jpg", HAPI_EDECODE, "bad \xc0\xaf");
    char *json = hapi_error_ring_json(r, shown_if_latin1, NULL);
    ck_assert_ptr_nonnull(json);
    ck_assert_ptr_nonnull(strstr(json, "\"path\": \"public/caf\\\\xe9.jpg\""));
    ck_assert_ptr_nonnull(strstr(json, "\"error\": \"public/caf\\\\xe9.jpg: truncated\""));
    ck_assert_ptr_nonnull(strstr(json, "\"hidden\": 1"));
    free(json);
    json = hapi_error_ring_json(r, NULL, NULL);
    /* valid UTF-8 kept as it is; an overlong form escaped byte by byte */
    ck_assert_ptr_nonnull(strstr(json, "\"path\": \"public/d\xc3\xa9j\xc3\xa0.jpg\""));
    ck_assert_ptr_nonnull(strstr(json, "\"error\": \"bad \\\\xc0\\\\xaf\""));
    free(json);
    hapi_error_ring_free(r);
}
END_TEST

/* A timed wait on a monotonic condition with hapi_deadline_after_ns() times out after the wait asked. */
START_TEST(test_deadline_monotonic)
{
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond;
    ck_assert_int_eq(hapi_cond_init_monotonic(&cond), 0);
    struct timespec ts;
    uint64_t t0 = hapi_now_ns();
    hapi_deadline_after_ns(&ts, 50 * 1000000u);
    uint64_t at = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    ck_assert_uint_ge(at, t0 + 50 * 1000000u);
    ck_assert_int_lt(ts.tv_nsec, 1000000000);
    pthread_mutex_lock(&lock);
    int rc;
    do
        rc = pthread_cond_timedwait(&cond, &lock, &ts);
    while (rc == 0);
    pthread_mutex_unlock(&lock);
    ck_assert_int_eq(rc, ETIMEDOUT);
    uint64_t waited = hapi_now_ns() - t0;
    ck_assert_uint_ge(waited, 50 * 1000000u);
    ck_assert_uint_lt(waited, UINT64_C(5000000000));
    pthread_cond_destroy(&cond);
}
END_TEST

/* A walk for the warm-up's state machine: holds until stopped, or returns at once. */
struct toy_walk {
    atomic_int hold, runs;
};

static void toy_run(void *arg, const char *root, atomic_int *stop)
{
    struct toy_walk *t = arg;
    (void)root;
    atomic_fetch_add(&t->runs, 1);
    while (atomic_load(&t->hold) && !atomic_load(stop))
        usleep(1000);
}

/* Waits up to 5 s for the warm-up to be done; returns its state. */
static int warmup_wait_done(hapi_warmup *w)
{
    hapi_warmup_status st;
    for (int i = 0; i < 5000; i++) {
        hapi_warmup_status_get(w, &st);
        free(st.root);
        if (st.state == HAPI_WARM_DONE)
            break;
        usleep(1000);
    }
    return st.state;
}

/* Start refuses while a run is unfinished, stop says it was and its root, a finished run is joined by the next start. */
START_TEST(test_warmup_state_machine)
{
    struct toy_walk t = { 1, 0 };
    hapi_warmup_ops ops = { .thread_name = "test-warm", .run = toy_run };
    hapi_warmup *w = hapi_warmup_new(&ops, &t);
    ck_assert_ptr_nonnull(w);
    hapi_warmup_status st;
    ck_assert_int_eq(hapi_warmup_status_get(w, &st), 0);
    ck_assert_int_eq(st.state, HAPI_WARM_IDLE);
    ck_assert_ptr_null(st.root);

    ck_assert_int_eq(hapi_warmup_start(w, "a/b"), 0);
    ck_assert_int_eq(hapi_warmup_start(w, "c"), -EBUSY);
    hapi_warmup_add(w, HAPI_WARMUP_TOTAL, 3);
    ck_assert_int_eq(hapi_warmup_status_get(w, &st), 0);
    ck_assert_int_eq(st.state, HAPI_WARM_RUNNING);
    ck_assert_str_eq(st.root, "a/b");
    ck_assert_uint_eq(st.count[HAPI_WARMUP_TOTAL], 3);
    free(st.root);

    char *root = NULL;
    ck_assert_int_eq(hapi_warmup_stop(w, 1, &root), 1);
    ck_assert_str_eq(root, "a/b");
    free(root);
    ck_assert_int_eq(hapi_warmup_status_get(w, &st), 0);
    ck_assert_int_eq(st.state, HAPI_WARM_STOPPED);
    ck_assert_uint_ge(st.stopped_ns, st.started_ns);
    free(st.root);
    ck_assert_int_eq(hapi_warmup_stop(w, 1, &root), 0);
    ck_assert_ptr_null(root);

    /* a run that ends by itself is done, its counters new, and the next start joins it */
    atomic_store(&t.hold, 0);
    ck_assert_int_eq(hapi_warmup_start(w, "c"), 0);
    ck_assert_int_eq(warmup_wait_done(w), HAPI_WARM_DONE);
    ck_assert_uint_eq(hapi_warmup_count(w, HAPI_WARMUP_TOTAL), 0);
    ck_assert_int_eq(hapi_warmup_stop(w, 1, NULL), 0);
    ck_assert_int_eq(hapi_warmup_start(w, "d"), 0);
    ck_assert_int_eq(warmup_wait_done(w), HAPI_WARM_DONE);
    ck_assert_int_eq(atomic_load(&t.runs), 3);
    hapi_warmup_free(w);
}
END_TEST

int main(void)
{
    hapi_log_open("/dev/null", 0, 0);
    setup();
    Suite *s = suite_create("fusefs");
    struct {
        const char *name;
        const TTest *test;
    } cases[] = {
        { "options_defaults", test_options_defaults },
        { "options_values", test_options_values },
        { "options_errors", test_options_errors },
        { "options_batch_range", test_options_batch_range },
        { "options_paths", test_options_paths },
        { "options_helper", test_options_helper },
        { "parse_size", test_parse_size },
        { "parse_time", test_parse_time },
        { "options_sharing", test_options_sharing },
        { "cred_may", test_cred_may },
        { "cred_read_groups", test_cred_read_groups },
        { "source_may_see", test_source_may_see },
        { "error_ring", test_error_ring },
        { "error_ring_filter", test_error_ring_filter },
        { "error_ring_not_utf8", test_error_ring_not_utf8 },
        { "deadline_monotonic", test_deadline_monotonic },
        { "warmup_state_machine", test_warmup_state_machine },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].test);
        suite_add_tcase(s, tc);
    }
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tmp);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
