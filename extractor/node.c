/* node.c — what the mounts of one node share: a memory budget and the cores, through a file every daemon maps. */
#include "extractor.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/*
 * The file (tmpfs, /run/hapifs/node by default) holds a header and a table of
 * slots, one per daemon, and one per profile waiting for the cores. Every change
 * happens under an open-file-description lock on the whole file, which the
 * kernel drops when a daemon dies; a slot names its process by pid and start
 * time, so a dead daemon's share is taken back by whoever next finds it.
 * Memory and cores each have a futex word (the map is shared, so the futex
 * is too) that changes at every release of theirs, and a count of waiters,
 * so a release wakes only those that wait for what it gave, and only if any
 * do; waiters look again every REAP_MS besides.
 */
#define NODE_MAGIC 0x68617069u /* "hapi" */
#define NODE_VERSION 3u
#define NODE_SLOTS 256
#define REAP_MS 100
#define ACTIVE_NS 1000000000ull /* a mount that ran an inference this recently is busy */

enum { SLOT_FREE = 0, SLOT_MOUNT = 1, SLOT_WAITER = 2 };
enum { CH_MEM, CH_CORES, CH_COUNT }; /* what a waiter waits for */

struct node_slot {
    int32_t kind;
    int32_t pid;
    uint64_t start;     /* the process's start time, in clock ticks after boot */
    uint64_t fixed;     /* MOUNT: bytes held while mounted (the model's share) */
    uint64_t flight;    /* MOUNT: bytes of images and tensors in flight */
    uint32_t cores;     /* MOUNT: threads its inferences run now */
    uint32_t alone;     /* MOUNT: it holds every core, to profile */
    int32_t owner;      /* WAITER: the mount that waits to profile */
    uint64_t ticket;    /* WAITER: place in the queue */
    uint64_t waits;     /* MOUNT: times it waited for memory or cores */
    uint64_t last_run;  /* MOUNT: when its last inference started or ended (CLOCK_MONOTONIC) */
    char name[80];      /* MOUNT: its mountpoint */
};

struct node_file {
    uint32_t magic, version;
    uint32_t cores;       /* core tokens of the node */
    struct {
        _Atomic uint32_t seq;     /* futex word: bumped at every release */
        _Atomic uint32_t waiting; /* threads asleep on it (a dead one's stays counted) */
    } ch[CH_COUNT];
    uint64_t mem_total;   /* bytes of the node budget */
    uint64_t next_ticket;
    uint64_t reaped;      /* slots of dead daemons taken back */
    struct node_slot slot[NODE_SLOTS];
};

struct hapi_node {
    int fd;
    struct node_file *f;
    int self;           /* this daemon's MOUNT slot */
    int32_t pid;
    uint64_t start;
};

/* ------------------------------------------------------------ processes */

/* The start time of pid (field 22 of /proc/PID/stat), or 0 if it is gone or a zombie. */
static uint64_t process_start(int32_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command may hold spaces and parentheses */
    if (!p)
        return 0;
    /* a zombie has died: only its parent has not collected it yet */
    if (p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'))
        return 0;
    /* after ")": field 3 (state) ... field 22 (starttime): 20 fields on */
    int field = 2;
    for (p++; *p && field < 22; p++)
        if (*p == ' ')
            field++;
    return field == 22 ? strtoull(p, NULL, 10) : 0;
}

static int slot_alive(const struct node_slot *s)
{
    return s->kind != SLOT_FREE && process_start(s->pid) == s->start;
}

/* ---------------------------------------------------------------- locking */

static int lock_file(int fd, short type)
{
    struct flock fl = { .l_type = type, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0 };
    while (fcntl(fd, F_OFD_SETLKW, &fl) < 0)
        if (errno != EINTR)
            return -errno;
    return 0;
}

static void lock(hapi_node *n)
{
    (void)lock_file(n->fd, F_WRLCK); /* only EINTR, retried, or a bad fd */
}

static void unlock(hapi_node *n)
{
    (void)lock_file(n->fd, F_UNLCK);
}

/* After a release on channel ch: wakes its waiters, if any (seq_cst: a waiter that counted
 * itself after this looked sees the new seq and does not sleep). */
static void wake(hapi_node *n, int ch)
{
    atomic_fetch_add(&n->f->ch[ch].seq, 1);
    if (atomic_load(&n->f->ch[ch].waiting))
        syscall(SYS_futex, &n->f->ch[ch].seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void wake_all(hapi_node *n)
{
    for (int ch = 0; ch < CH_COUNT; ch++)
        wake(n, ch);
}

static uint32_t seq_of(hapi_node *n, int ch)
{
    return atomic_load(&n->f->ch[ch].seq);
}

/* Sleeps until channel ch's seq moves past seen (read under the lock), or REAP_MS. */
static void wait_change(hapi_node *n, int ch, uint32_t seen)
{
    struct timespec ts = { 0, REAP_MS * 1000000L };
    atomic_fetch_add(&n->f->ch[ch].waiting, 1);
    syscall(SYS_futex, &n->f->ch[ch].seq, FUTEX_WAIT, seen, &ts, NULL, 0);
    atomic_fetch_sub(&n->f->ch[ch].waiting, 1);
}

/* Under the lock: frees the slots of dead processes. Returns how many. */
static int reap(hapi_node *n)
{
    int freed = 0;
    for (int i = 0; i < NODE_SLOTS; i++) {
        struct node_slot *s = &n->f->slot[i];
        if (s->kind != SLOT_FREE && !slot_alive(s)) {
            memset(s, 0, sizeof(*s));
            freed++;
        }
    }
    n->f->reaped += (uint64_t)freed;
    return freed;
}

static int take_slot(hapi_node *n, int kind)
{
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < NODE_SLOTS; i++) {
            struct node_slot *s = &n->f->slot[i];
            if (s->kind == SLOT_FREE) {
                memset(s, 0, sizeof(*s));
                s->kind = kind;
                s->pid = n->pid;
                s->start = n->start;
                return i;
            }
        }
        if (!reap(n))
            break;
    }
    return -1;
}

/* ------------------------------------------------------------------- sums */

static uint64_t mem_used(const struct node_file *f)
{
    uint64_t sum = 0;
    for (int i = 0; i < NODE_SLOTS; i++)
        if (f->slot[i].kind == SLOT_MOUNT)
            sum += f->slot[i].fixed + f->slot[i].flight;
    return sum;
}

static uint32_t cores_used(const struct node_file *f)
{
    uint32_t sum = 0;
    for (int i = 0; i < NODE_SLOTS; i++)
        if (f->slot[i].kind == SLOT_MOUNT)
            sum += f->slot[i].cores;
    return sum;
}

/* ------------------------------------------------------------------- open */

static uint64_t default_mem(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size / 2 : 1ull << 30;
}

int hapi_node_open(const hapi_node_config *cfg, hapi_node **out, hapi_error *err)
{
    *out = NULL;
    const char *path = cfg->path;
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        if (mkdir(dir, 0755) < 0 && errno != EEXIST)
            return hapi_error_set(err, -errno, "%s: %s", dir, strerror(errno));
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return hapi_error_set(err, -errno, "%s: %s", path, strerror(errno));
    int rc = lock_file(fd, F_WRLCK);
    if (rc < 0) {
        close(fd);
        return hapi_error_set(err, rc, "%s: cannot lock: %s", path, strerror(-rc));
    }
    struct stat st;
    int fresh = fstat(fd, &st) == 0 && st.st_size == 0;
    if (fresh && ftruncate(fd, (off_t)sizeof(struct node_file)) < 0) {
        rc = -errno;
        goto fail;
    }
    if (!fresh && st.st_size != (off_t)sizeof(struct node_file)) {
        rc = hapi_error_set(err, -EINVAL, "%s: not a hapifs node file of this version "
                            "(%lld bytes); remove it when no hapifs is mounted",
                            path, (long long)st.st_size);
        close(fd);
        return rc;
    }
    struct node_file *f = mmap(NULL, sizeof(*f), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (f == MAP_FAILED) {
        rc = -errno;
        goto fail;
    }
    if (fresh) {
        f->magic = NODE_MAGIC;
        f->version = NODE_VERSION;
        f->mem_total = cfg->mem_total ? cfg->mem_total : default_mem();
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        f->cores = cfg->cores > 0 ? (uint32_t)cfg->cores : ncpu > 0 ? (uint32_t)ncpu : 1;
    } else if (f->magic != NODE_MAGIC || f->version != NODE_VERSION) {
        munmap(f, sizeof(*f));
        rc = hapi_error_set(err, -EINVAL, "%s: not a hapifs node file of this version; "
                            "remove it when no hapifs is mounted", path);
        close(fd);
        return rc;
    } else {
        /* the operator's latest word sets the node's figures */
        if (cfg->mem_total)
            f->mem_total = cfg->mem_total;
        if (cfg->cores > 0)
            f->cores = (uint32_t)cfg->cores;
    }
    hapi_node *n = calloc(1, sizeof(*n));
    if (!n) {
        munmap(f, sizeof(*f));
        rc = -ENOMEM;
        goto fail;
    }
    *n = (hapi_node){ .fd = fd, .f = f, .pid = (int32_t)getpid() };
    n->start = process_start(n->pid);
    reap(n);
    n->self = take_slot(n, SLOT_MOUNT);
    if (n->self < 0) {
        unlock(n);
        munmap(f, sizeof(*f));
        close(fd);
        free(n);
        return hapi_error_set(err, -EMFILE, "%s: all %d slots are taken", path, NODE_SLOTS);
    }
    snprintf(f->slot[n->self].name, sizeof(f->slot[n->self].name), "%s",
             cfg->name ? cfg->name : "");
    unlock(n);
    wake_all(n); /* a waiter that counted on a reaped slot's share looks again */
    *out = n;
    return 0;
fail:
    close(fd);
    return hapi_error_set(err, rc, "%s: %s", path, strerror(-rc));
}

void hapi_node_close(hapi_node *n)
{
    if (!n)
        return;
    lock(n);
    memset(&n->f->slot[n->self], 0, sizeof(n->f->slot[n->self])); /* waiters leave on their own */
    unlock(n);
    wake_all(n);
    munmap(n->f, sizeof(*n->f));
    close(n->fd);
    free(n);
}

/* ----------------------------------------------------------------- memory */

void hapi_node_set_fixed(hapi_node *n, uint64_t bytes)
{
    if (!n)
        return;
    lock(n);
    uint64_t before = n->f->slot[n->self].fixed;
    n->f->slot[n->self].fixed = bytes;
    unlock(n);
    if (bytes < before)
        wake(n, CH_MEM);
}

int hapi_node_mem_take(hapi_node *n, uint64_t bytes, const hapi_stop_flag *stop)
{
    if (!n || !bytes)
        return 0;
    int waited = 0;
    uint64_t since = hapi_now_ns();
    for (;;) {
        lock(n);
        uint32_t seen = seq_of(n, CH_MEM);
        struct node_slot *me = &n->f->slot[n->self];
        /* with nothing of its own in flight a mount may go over: every mount progresses */
        if (me->flight == 0 || mem_used(n->f) + bytes <= n->f->mem_total) {
            me->flight += bytes;
            me->waits += (uint64_t)waited;
            unlock(n);
            return 0;
        }
        if (hapi_now_ns() - since > REAP_MS * 1000000ull) {
            reap(n);
            since = hapi_now_ns();
        }
        unlock(n);
        if (stop && atomic_load(stop))
            return -ECANCELED;
        waited = 1;
        wait_change(n, CH_MEM, seen);
    }
}

void hapi_node_mem_give(hapi_node *n, uint64_t bytes)
{
    if (!n || !bytes)
        return;
    lock(n);
    struct node_slot *me = &n->f->slot[n->self];
    me->flight = me->flight > bytes ? me->flight - bytes : 0;
    unlock(n);
    wake(n, CH_MEM);
}

/* ------------------------------------------------------------------ cores */

/*
 * Under the lock: the mounts busy computing, this one included: those that
 * run an inference, ran one within ACTIVE_NS, or wait to profile. The cores
 * are divided among them, so a mount alone runs all its threads and in a
 * crowd each inference runs fewer; the count changes only as mounts start
 * and stop computing, so a mount's thread count seldom changes.
 */
static uint32_t busy_mounts(hapi_node *n)
{
    uint64_t now = hapi_now_ns();
    unsigned char waits[NODE_SLOTS] = { 0 };
    for (int k = 0; k < NODE_SLOTS; k++) {
        const struct node_slot *q = &n->f->slot[k];
        if (q->kind == SLOT_WAITER && q->owner >= 0 && q->owner < NODE_SLOTS)
            waits[q->owner] = 1;
    }
    uint32_t busy = 1;
    for (int i = 0; i < NODE_SLOTS; i++) {
        const struct node_slot *s = &n->f->slot[i];
        if (i != n->self && s->kind == SLOT_MOUNT &&
            (waits[i] || s->cores || (s->last_run && now - s->last_run < ACTIVE_NS)))
            busy++;
    }
    return busy;
}

/* Under the lock: whether any mount profiles (holds the node alone) or waits to. */
static int profile_pending(hapi_node *n)
{
    for (int i = 0; i < NODE_SLOTS; i++) {
        const struct node_slot *s = &n->f->slot[i];
        if (s->kind == SLOT_WAITER || (s->kind == SLOT_MOUNT && s->alone))
            return 1;
    }
    return 0;
}

/* Under the lock: whether the waiter in slot w is the oldest live one. */
static int first_in_line(hapi_node *n, int w)
{
    for (int i = 0; i < NODE_SLOTS; i++) {
        const struct node_slot *s = &n->f->slot[i];
        if (i != w && s->kind == SLOT_WAITER && s->ticket < n->f->slot[w].ticket)
            return 0;
    }
    return 1;
}

int hapi_node_cores_take(hapi_node *n, int want, int alone, const hapi_stop_flag *stop)
{
    if (!n)
        return 0;
    lock(n);
    if (want < 1)
        want = 1;
    if ((uint32_t)want > n->f->cores)
        want = (int)n->f->cores;
    int w = -1;
    if (alone) {
        /* in line behind the other profiles; nobody starts an inference meanwhile */
        w = take_slot(n, SLOT_WAITER);
        if (w < 0) {
            unlock(n);
            return 0; /* no room to queue: measure beside the others rather than stall */
        }
        n->f->slot[w].owner = n->self;
        n->f->slot[w].ticket = ++n->f->next_ticket;
    }
    uint64_t since = hapi_now_ns();
    int waited = 0;
    for (;;) {
        struct node_slot *me = &n->f->slot[n->self];
        uint32_t take = 0;
        if (!alone && !profile_pending(n)) {
            uint32_t share = n->f->cores / busy_mounts(n);
            take = (uint32_t)want < share ? (uint32_t)want : share < 1 ? 1 : share;
        } else if (alone && first_in_line(n, w) && cores_used(n->f) == 0) {
            take = n->f->cores;
            me->alone = 1;
            memset(&n->f->slot[w], 0, sizeof(n->f->slot[w]));
        }
        if (take) {
            me->cores += take;
            me->last_run = hapi_now_ns();
            me->waits += (uint64_t)waited;
            unlock(n);
            return (int)take;
        }
        if (hapi_now_ns() - since > REAP_MS * 1000000ull) {
            reap(n);
            since = hapi_now_ns();
        }
        uint32_t seen = seq_of(n, CH_CORES);
        unlock(n);
        if (stop && atomic_load(stop)) {
            if (w >= 0) {
                lock(n);
                memset(&n->f->slot[w], 0, sizeof(n->f->slot[w]));
                unlock(n);
                wake(n, CH_CORES);
            }
            return -ECANCELED;
        }
        waited = 1;
        wait_change(n, CH_CORES, seen);
        lock(n);
    }
}

void hapi_node_cores_give(hapi_node *n, int count)
{
    if (!n || count <= 0)
        return;
    lock(n);
    struct node_slot *me = &n->f->slot[n->self];
    me->cores = me->cores > (uint32_t)count ? me->cores - (uint32_t)count : 0;
    if (!me->cores)
        me->alone = 0;
    me->last_run = hapi_now_ns();
    unlock(n);
    wake(n, CH_CORES);
}

/* ------------------------------------------------------------------ stats */

void hapi_node_stats_get(hapi_node *n, hapi_node_stats *st)
{
    memset(st, 0, sizeof(*st));
    if (!n)
        return;
    lock(n);
    const struct node_file *f = n->f;
    st->mem_total = f->mem_total;
    st->cores = f->cores;
    st->reaped = f->reaped;
    for (int i = 0; i < NODE_SLOTS; i++) {
        const struct node_slot *s = &f->slot[i];
        if (s->kind == SLOT_MOUNT) {
            st->mounts++;
            st->mem_used += s->fixed + s->flight;
            st->cores_used += s->cores;
        } else if (s->kind == SLOT_WAITER) {
            st->waiting++;
        }
    }
    const struct node_slot *me = &f->slot[n->self];
    st->own_fixed = me->fixed;
    st->own_flight = me->flight;
    st->own_waits = me->waits;
    unlock(n);
}
