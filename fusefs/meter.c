/* meter.c — the transport's CPU per file, measured on this node (policy: storage_file_ms). */
#include "fusefs-int.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/*
 * A .feat's first read (offset 0) names its reader. A reader that is an SFTP
 * server (OpenSSH's sftp-server, or an sshd serving internal-sftp) is followed:
 * its CPU time, with that of its parent sshd (the channel and the cipher), is
 * read from /proc every METER_WINDOW files it reads, and each such window gives
 * a cost per file. Other readers (a training loop on this node, the kernel's
 * nfsd) are not: their CPU is not the transport's.
 *
 * Only reads that reach the daemon are counted: a file the kernel serves from
 * its page cache (a warm epoch; no_open) costs its server CPU and is seen by
 * no one, and so do a server's other requests (directory listings, stats). A
 * window holding such work reads high, never low; a first pass over a tree is
 * all counted. So the estimate is the lower quartile of the last windows.
 *
 * A followed process is held by a descriptor of its /proc directory: once it
 * has exited, reads through it fail, whatever process gets its number.
 */

#define METER_SLOTS 32         /* readers remembered (followed or not) */
#define METER_WINDOW 64        /* files per window */
#define METER_RING 32          /* windows the estimate is taken from */
#define METER_RECHECK 4096     /* a reader not followed is looked at again after these reads
                                  (its number may have gone to another process) */

struct meter_slot {
    pid_t pid;                 /* 0: free */
    int follow;                /* an SFTP server: self (and parent) are read */
    int self_fd, parent_fd;    /* /proc/<pid>, /proc/<ppid>; -1: none */
    char server[16];           /* its comm */
    uint64_t cpu0_ns;          /* at the window's start */
    unsigned files;            /* read in the window (followed) or since looked at (not) */
    uint64_t used;             /* the meter's clock at the last read: the least recent goes */
};

struct hapi_meter {
    int proc_fd;
    char *path;                /* where the estimate is kept between mounts; NULL: nowhere */
    pthread_mutex_t lock;
    struct meter_slot slot[METER_SLOTS];
    uint64_t clock;
    double ring[METER_RING];   /* ms per file of the last windows */
    uint64_t windows, files;   /* windows closed, the files in them */
    double cpu_ms;             /* their CPU */
    char server[16];           /* the last followed reader's comm */
    uint64_t saved_at;         /* windows when last saved */
    double stored_ms;          /* the estimate the previous mount kept; < 0: none */
    uint64_t stored_files;
    char stored_server[16];
};

/* Reads NAME under dirfd into buf (NUL-terminated, trailing newline dropped). */
static int read_small(int dirfd, const char *name, char *buf, size_t size)
{
    int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n = read(fd, buf, size - 1);
    int e = errno;
    close(fd);
    if (n < 0)
        return -e;
    buf[n] = '\0';
    if (n > 0 && buf[n - 1] == '\n')
        buf[n - 1] = '\0';
    return 0;
}

/* The CPU time of the process whose /proc directory is dirfd, in ns: its schedstat (exact),
   else its stat's utime + stime (clock ticks). */
static int cpu_ns(int dirfd, uint64_t *ns)
{
    char buf[1024];
    if (read_small(dirfd, "schedstat", buf, sizeof(buf)) == 0) {
        char *end;
        unsigned long long v = strtoull(buf, &end, 10);
        if (end != buf) {
            *ns = v;
            return 0;
        }
    }
    int rc = read_small(dirfd, "stat", buf, sizeof(buf));
    if (rc < 0)
        return rc;
    /* after the command's closing parenthesis: state (3), ... utime (14), stime (15) */
    const char *p = strrchr(buf, ')');
    unsigned long long ut, st;
    if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut,
                     &st) != 2)
        return -EIO;
    long hz = sysconf(_SC_CLK_TCK);
    *ns = (ut + st) * (1000000000ull / (unsigned long long)(hz > 0 ? hz : 100));
    return 0;
}

static int slot_cpu(const struct meter_slot *s, uint64_t *ns)
{
    uint64_t self = 0, parent = 0;
    int rc = cpu_ns(s->self_fd, &self);
    if (rc == 0 && s->parent_fd >= 0)
        rc = cpu_ns(s->parent_fd, &parent);
    *ns = self + parent;
    return rc;
}

static void slot_clear(struct meter_slot *s)
{
    if (s->self_fd >= 0)
        close(s->self_fd);
    if (s->parent_fd >= 0)
        close(s->parent_fd);
    memset(s, 0, sizeof(*s));
    s->self_fd = s->parent_fd = -1;
}

static int is_sshd(const char *comm)
{
    return strcmp(comm, "sshd") == 0 || strcmp(comm, "sshd-session") == 0;
}

/* Looks at pid: an SFTP server is followed from now on (its window starts empty). */
static void slot_classify(hapi_meter *m, struct meter_slot *s, pid_t pid)
{
    char name[32], comm[64], stat[1024];
    slot_clear(s);
    s->pid = pid;
    snprintf(name, sizeof(name), "%d", (int)pid);
    int fd = openat(m->proc_fd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return;
    if (read_small(fd, "comm", comm, sizeof(comm)) < 0 ||
        !(strcmp(comm, "sftp-server") == 0 || is_sshd(comm))) {
        close(fd);
        return;
    }
    s->self_fd = fd;
    snprintf(s->server, sizeof(s->server), "%.15s", comm);
    /* sftp-server's parent, an sshd, carries its channel and the cipher */
    const char *p = read_small(fd, "stat", stat, sizeof(stat)) == 0 ? strrchr(stat, ')') : NULL;
    int ppid = 0;
    if (!is_sshd(comm) && p && sscanf(p + 1, " %*c %d", &ppid) == 1 && ppid > 1) {
        snprintf(name, sizeof(name), "%d", ppid);
        int pfd = openat(m->proc_fd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (pfd >= 0 && read_small(pfd, "comm", comm, sizeof(comm)) == 0 && is_sshd(comm))
            s->parent_fd = pfd;
        else if (pfd >= 0)
            close(pfd);
    }
    if (slot_cpu(s, &s->cpu0_ns) < 0) {
        slot_clear(s);
        s->pid = pid;
        return;
    }
    s->follow = 1;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The lower quartile of the ring; lock held. */
static double estimate_locked(const hapi_meter *m)
{
    size_t n = m->windows < METER_RING ? (size_t)m->windows : METER_RING;
    double v[METER_RING];
    memcpy(v, m->ring, n * sizeof(double));
    qsort(v, n, sizeof(double), cmp_double);
    return n ? v[(n - 1) / 4] : 0;
}

static int save(const char *path, double ms, uint64_t windows, uint64_t files,
                const char *server)
{
    char stamp[32], tmp[4300];
    time_t now = time(NULL);
    struct tm tm;
    strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
    json_t *j = json_pack("{s:f, s:I, s:I, s:s, s:s}", "storage_file_ms", ms, "windows",
                          (json_int_t)windows, "files", (json_int_t)files, "server", server,
                          "measured", stamp);
    if (!j)
        return -ENOMEM;
    snprintf(tmp, sizeof(tmp), "%s.%d.%llu.tmp", path, (int)getpid(),
             (unsigned long long)windows); /* each save its own: two may overlap */
    int rc = json_dump_file(j, tmp, JSON_INDENT(2)) == 0 ? 0 : -EIO;
    json_decref(j);
    if (rc == 0 && rename(tmp, path) < 0)
        rc = -errno;
    if (rc < 0)
        unlink(tmp);
    return rc;
}

static void load(hapi_meter *m)
{
    json_error_t jerr;
    json_t *j = m->path ? json_load_file(m->path, 0, &jerr) : NULL;
    double ms = -1;
    json_int_t files = 0;
    const char *server = "";
    if (j && json_unpack(j, "{s:F, s?I, s?s}", "storage_file_ms", &ms, "files", &files,
                         "server", &server) == 0 && ms >= 0 && ms < 1e3) {
        m->stored_ms = ms;
        m->stored_files = files > 0 ? (uint64_t)files : 0;
        snprintf(m->stored_server, sizeof(m->stored_server), "%s", server);
    } else if (j || (m->path && access(m->path, F_OK) == 0)) {
        hapi_log(HAPI_LOG_WARNING, "%s: not a transport measurement; not used", m->path);
    }
    json_decref(j);
}

int hapi_meter_new(const char *proc, const char *path, hapi_meter **out)
{
    *out = NULL;
    hapi_meter *m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->proc_fd = open(proc, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (m->proc_fd < 0) {
        int rc = -errno;
        free(m);
        return rc;
    }
    if (path && !(m->path = strdup(path))) {
        close(m->proc_fd);
        free(m);
        return -ENOMEM;
    }
    pthread_mutex_init(&m->lock, NULL);
    for (int i = 0; i < METER_SLOTS; i++)
        m->slot[i].self_fd = m->slot[i].parent_fd = -1;
    m->stored_ms = -1;
    load(m);
    *out = m;
    return 0;
}

void hapi_meter_free(hapi_meter *m)
{
    if (!m)
        return;
    for (int i = 0; i < METER_SLOTS; i++)
        slot_clear(&m->slot[i]);
    close(m->proc_fd);
    pthread_mutex_destroy(&m->lock);
    free(m->path);
    free(m);
}

void hapi_meter_first_read(hapi_meter *m, pid_t pid)
{
    if (!m || pid <= 0)
        return;
    pthread_mutex_lock(&m->lock);
    m->clock++;
    struct meter_slot *s = NULL, *victim = &m->slot[0];
    for (int i = 0; i < METER_SLOTS && !s; i++) {
        if (m->slot[i].pid == pid)
            s = &m->slot[i];
        else if (m->slot[i].used < victim->used)
            victim = &m->slot[i];
    }
    if (!s || (!s->follow && ++s->files >= METER_RECHECK)) {
        s = s ? s : victim;
        slot_classify(m, s, pid); /* a new reader: its window starts after this file */
        s->used = m->clock;
        pthread_mutex_unlock(&m->lock);
        return;
    }
    s->used = m->clock;
    if (!s->follow || ++s->files < METER_WINDOW) {
        pthread_mutex_unlock(&m->lock);
        return;
    }
    uint64_t now = 0;
    if (slot_cpu(s, &now) < 0) { /* it has exited: its last window is lost */
        slot_clear(s);
        pthread_mutex_unlock(&m->lock);
        return;
    }
    double ms = (double)(now - s->cpu0_ns) / 1e6;
    m->ring[m->windows % METER_RING] = ms / s->files;
    m->windows++;
    m->files += s->files;
    m->cpu_ms += ms;
    snprintf(m->server, sizeof(m->server), "%s", s->server);
    s->cpu0_ns = now;
    s->files = 0;
    /* kept at the first estimate and as the windows double: the next mount starts from it */
    char *path = NULL, server[16];
    double est = 0;
    uint64_t windows = m->windows, files = m->files;
    if (m->path && windows >= HAPI_METER_MIN_WINDOWS && windows >= 2 * m->saved_at) {
        m->saved_at = windows;
        path = strdup(m->path);
        est = estimate_locked(m);
        memcpy(server, m->server, sizeof(server));
    }
    pthread_mutex_unlock(&m->lock);
    if (path) {
        int rc = save(path, est, windows, files, server);
        if (rc < 0)
            hapi_log(HAPI_LOG_WARNING, "%s: transport measurement not kept: %s", path,
                     hapi_strerror(rc));
        free(path);
    }
}

void hapi_meter_stats_get(hapi_meter *m, hapi_meter_stats *st)
{
    memset(st, 0, sizeof(*st));
    st->stored_ms = -1;
    if (!m)
        return;
    pthread_mutex_lock(&m->lock);
    st->windows = m->windows;
    st->files = m->files;
    st->cpu_ms = m->cpu_ms;
    st->ms_per_file = estimate_locked(m);
    for (int i = 0; i < METER_SLOTS; i++)
        st->followed += m->slot[i].follow;
    snprintf(st->server, sizeof(st->server), "%s", m->server);
    st->stored_ms = m->stored_ms;
    st->stored_files = m->stored_files;
    snprintf(st->stored_server, sizeof(st->stored_server), "%s", m->stored_server);
    pthread_mutex_unlock(&m->lock);
}

double hapi_meter_file_ms(hapi_meter *m, double fallback, const char **source)
{
    hapi_meter_stats st;
    hapi_meter_stats_get(m, &st);
    if (st.windows >= HAPI_METER_MIN_WINDOWS) {
        *source = "measured";
        return st.ms_per_file;
    }
    if (st.stored_ms >= 0) {
        *source = "stored";
        return st.stored_ms;
    }
    *source = "default";
    return fallback;
}
