/*
 * uring.c — serving FUSE requests through io_uring ("FUSE over io_uring",
 * Linux 6.14 and later, with the fuse module's enable_uring set).
 *
 * Why: through /dev/fuse every request wakes a daemon thread that sleeps on
 * whichever CPU it last ran. On a virtual machine that is a halted vCPU, and
 * waking it costs an exit and an IPI: about 80 us per round trip here, where
 * the same round trip with reader and daemon on one CPU costs 12 us. Python's
 * open() sends one such request per file (an ioctl, for isatty), so a warm
 * DataLoader epoch paid it on every file. The kernel's io_uring transport has
 * one queue per CPU: a request goes to the queue of the CPU its caller runs on,
 * and a daemon thread kept on that CPU takes it, so the caller's CPU switches
 * to the daemon and back instead of waking another one.
 *
 * How, with Debian's libfuse 3.14, which knows nothing of the ring: each
 * worker thread owns an io_uring and one ring entry (a header buffer and a
 * payload buffer registered with the kernel) on one CPU's queue. A request
 * arrives as a completion; the worker lays it out as /dev/fuse would have
 * delivered it (in header, op header, payload: contiguous, in front of the
 * payload so nothing large is copied) and hands it to
 * fuse_session_process_buf(), so every operation is served by the same code
 * as before. The reply comes back through the session's custom writev, which
 * recognises the reply to the request this thread is serving (a thread-local
 * and the request's unique id) and copies it into the ring entry; every other
 * write (notifications, replies to requests read from /dev/fuse) goes to
 * /dev/fuse as before. The worker then commits the reply and fetches the next
 * request in one submission. Every reply in fs.c is made by the thread that
 * runs the operation, which is what makes a thread-local enough.
 *
 * Not everything moves to the ring: forgets and interrupts still come through
 * /dev/fuse, as does everything before the ring is complete (the kernel uses
 * it only once every CPU's queue has an entry), so libfuse's own loop keeps
 * running beside the workers. Where the kernel has no such transport (Debian
 * 12's 6.1), enable_uring is off, or registering fails, nothing changes: the
 * custom io is not installed and requests come through /dev/fuse.
 *
 * The kernel's interface (include/uapi/linux/fuse.h, protocol 7.42) is not in
 * Debian 12's headers, so its few structures are declared here.
 */
#include "uring.h"
#include "hapi.h"
#include "log.h"

#include <fuse_lowlevel.h>

#include <errno.h>
#include <liburing.h>
#include <linux/fuse.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#define URING_PARAM "/sys/module/fuse/parameters/enable_uring"

/* The kernel's ring interface (uapi fuse.h 7.42). */
enum { URING_CMD_REGISTER = 1, URING_CMD_COMMIT_AND_FETCH = 2 };
#define URING_HEADER_SZ 128 /* in_out: the in or out header */
#define URING_OP_SZ 128     /* op_in: the operation's own header */
struct uring_ent_in_out {
    uint64_t flags;
    uint64_t commit_id; /* the request's unique id, to name it in the commit */
    uint32_t payload_sz;
    uint32_t padding;
    uint64_t reserved;
};
struct uring_req_header {
    char in_out[URING_HEADER_SZ];
    char op_in[URING_OP_SZ];
    struct uring_ent_in_out ent;
};
struct uring_cmd_req {
    uint64_t flags;
    uint64_t commit_id;
    uint16_t qid;
    uint8_t padding[6];
};

/*
 * The payload buffer: at least the kernel's largest request or reply,
 * max(8 KiB, max_write, max_pages pages), which libfuse's 1 MiB max_write and
 * the kernel's 256-page limit bound at 1 MiB. It is mapped, not touched: a
 * worker's resident memory is what its requests used.
 */
#define PAYLOAD_SZ ((size_t)1 << 20)
/* Room in front of the payload for the in header and the op header. */
#define HEADROOM 256

enum { TAG_ENTRY = 1, TAG_STOP = 2 };

struct uring_worker {
    hapi_uring *u;
    pthread_t tid;
    int started;
    int qid;                      /* the CPU whose queue this worker serves */
    struct io_uring ring;
    struct uring_req_header *hdr; /* registered with the kernel (iov[0]) */
    char *buf;                    /* HEADROOM bytes, then the payload (iov[1]) */
    struct iovec iov[2];
    uint64_t unique;              /* the request being served */
    int replied;                  /* its reply is in the entry */
};

struct hapi_uring {
    struct fuse_session *se;
    int fd;                       /* /dev/fuse (the session's; not owned) */
    int stop_fd;                  /* eventfd: readable once the workers must stop */
    int nqueues;
    int nworkers;
    struct uring_worker *w;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int initialized;              /* the kernel has the session's INIT reply (or soon) */
    int stopping;
    atomic_int registered;        /* workers whose entry the kernel accepted */
    atomic_uint_fast64_t requests; /* requests served through the ring */
};

/* The worker this thread is, NULL on any other thread (libfuse's, fs.c's). */
static _Thread_local struct uring_worker *current;

int hapi_uring_available(void)
{
    char c = 0;
    FILE *f = fopen(URING_PARAM, "r");
    if (!f)
        return 0;
    if (fread(&c, 1, 1, f) != 1)
        c = 0;
    fclose(f);
    return c == 'Y' || c == '1';
}

static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
    (void)userdata;
    return read(fd, buf, len);
}

/*
 * Every reply and notification libfuse sends. The reply to the request this
 * worker serves goes into its ring entry; anything else to /dev/fuse.
 */
static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    (void)userdata;
    struct uring_worker *w = current;
    if (w && !w->replied && count > 0 && iov[0].iov_len == sizeof(struct fuse_out_header)) {
        const struct fuse_out_header *oh = iov[0].iov_base;
        if (oh->unique == w->unique) {
            size_t total = 0;
            for (int i = 1; i < count; i++)
                total += iov[i].iov_len;
            if (total > PAYLOAD_SZ) {
                errno = EINVAL;
                return -1;
            }
            char *p = w->buf + HEADROOM;
            for (int i = 1; i < count; i++) {
                memmove(p, iov[i].iov_base, iov[i].iov_len);
                p += iov[i].iov_len;
            }
            memcpy(w->hdr->in_out, oh, sizeof(*oh));
            w->hdr->ent.payload_sz = (uint32_t)total;
            w->replied = 1;
            return (ssize_t)(sizeof(*oh) + total);
        }
    }
    return writev(fd, iov, count);
}

static const struct fuse_custom_io uring_io = {
    .writev = io_writev,
    .read = io_read,
};

static void prep_cmd(struct uring_worker *w, int op, uint64_t commit_id)
{
    /* The ring has room for this and the stop poll: one submission at a time. */
    struct io_uring_sqe *sqe = io_uring_get_sqe(&w->ring);
    io_uring_prep_rw(IORING_OP_URING_CMD, sqe, w->u->fd, w->iov, 2, 0);
    sqe->cmd_op = (uint32_t)op;
    sqe->user_data = TAG_ENTRY;
    /* SQE128: the command's own bytes (struct uring_cmd_req) are the second half. */
    struct uring_cmd_req req = { .commit_id = commit_id, .qid = (uint16_t)w->qid };
    unsigned char *cmd = (unsigned char *)(uintptr_t)sqe + offsetof(struct io_uring_sqe, cmd);
    memset(cmd, 0, 128 - offsetof(struct io_uring_sqe, cmd));
    memcpy(cmd, &req, sizeof(req));
}

/* Serves the request in w's entry; leaves the reply there. */
static void serve(struct uring_worker *w)
{
    hapi_uring *u = w->u;
    const struct fuse_in_header *ih = (const void *)w->hdr->in_out;
    uint32_t psz = w->hdr->ent.payload_sz;
    w->unique = ih->unique;
    w->replied = 0;
    size_t fixed = sizeof(*ih) + psz;
    if (ih->len < fixed || ih->len - fixed > URING_OP_SZ || psz > PAYLOAD_SZ) {
        hapi_log(HAPI_LOG_ERROR, "io_uring: request %u of %u bytes with a %u-byte payload: "
                 "not a layout this daemon knows; answered EIO", ih->opcode, ih->len, psz);
    } else {
        /* As /dev/fuse delivers it: in header, op header, payload. */
        size_t oplen = ih->len - fixed;
        char *start = w->buf + HEADROOM - oplen - sizeof(*ih);
        memcpy(start, ih, sizeof(*ih));
        memcpy(start + sizeof(*ih), w->hdr->op_in, oplen);
        struct fuse_buf fb = { .size = ih->len, .mem = start };
        fuse_session_process_buf(u->se, &fb);
        atomic_fetch_add_explicit(&u->requests, 1, memory_order_relaxed);
    }
    if (!w->replied) {
        /* Every request through the ring waits for a reply (forgets do not come this way). */
        struct fuse_out_header oh = { .len = sizeof(oh), .error = -EIO, .unique = w->unique };
        memcpy(w->hdr->in_out, &oh, sizeof(oh));
        w->hdr->ent.payload_sz = 0;
        w->replied = 1;
    }
}

static void pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    /* Refused where the daemon's cpuset lacks cpu: it then runs where it may. */
    (void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void *worker_main(void *arg)
{
    struct uring_worker *w = arg;
    pthread_setname_np(pthread_self(), "hapifs-uring");
    hapi_uring *u = w->u;
    current = w;
    pin(w->qid);

    pthread_mutex_lock(&u->lock);
    while (!u->initialized && !u->stopping)
        pthread_cond_wait(&u->cond, &u->lock);
    int stop = u->stopping;
    pthread_mutex_unlock(&u->lock);
    if (stop)
        return NULL;

    struct io_uring_sqe *sqe = io_uring_get_sqe(&w->ring);
    io_uring_prep_poll_add(sqe, u->stop_fd, POLLIN);
    sqe->user_data = TAG_STOP;
    prep_cmd(w, URING_CMD_REGISTER, 0);
    int rc = io_uring_submit(&w->ring);
    int counted = 0, retries = 0;
    for (;;) {
        struct io_uring_cqe *cqe;
        if (rc >= 0 || rc == -EINTR) {
            if (counted) {
                rc = io_uring_wait_cqe(&w->ring, &cqe);
            } else {
                /*
                 * A register that the kernel accepts completes only when a
                 * request comes; one it refuses completes at once.
                 */
                struct __kernel_timespec ts = { .tv_sec = 0, .tv_nsec = 50 * 1000 * 1000 };
                rc = io_uring_wait_cqe_timeout(&w->ring, &cqe, &ts);
                if (rc == -ETIME) {
                    counted = 1;
                    atomic_fetch_add(&u->registered, 1);
                    rc = 0;
                    continue;
                }
            }
        }
        if (rc == -EINTR) {
            rc = 0;
            continue;
        }
        if (rc < 0) {
            hapi_log(HAPI_LOG_ERROR, "io_uring: queue %d: %s", w->qid, strerror(-rc));
            break;
        }
        uint64_t tag = cqe->user_data;
        int res = cqe->res;
        io_uring_cqe_seen(&w->ring, cqe);
        if (tag == TAG_STOP)
            break;
        if (res < 0) {
            if (counted) {
                counted = 0;
                atomic_fetch_sub(&u->registered, 1);
            }
            if (res == -ENOTCONN || res == -ECONNABORTED || res == -ECANCELED)
                break; /* unmounted, or the connection was aborted */
            if (res == -EOPNOTSUPP || res == -EINVAL || ++retries > 2000) {
                hapi_log(HAPI_LOG_WARNING, "io_uring: queue %d: %s; requests go through "
                         "/dev/fuse", w->qid, strerror(-res));
                break;
            }
            if (res == -EAGAIN) {
                usleep(2000); /* the kernel has not had the INIT reply yet */
            } else {
                hapi_log(HAPI_LOG_WARNING, "io_uring: queue %d: %s; registering again",
                         w->qid, strerror(-res));
            }
            prep_cmd(w, URING_CMD_REGISTER, 0);
            rc = io_uring_submit(&w->ring);
            continue;
        }
        if (!counted) {
            counted = 1;
            atomic_fetch_add(&u->registered, 1);
        }
        serve(w);
        prep_cmd(w, URING_CMD_COMMIT_AND_FETCH, w->unique);
        /* One system call: the reply, then wait for the next request. */
        rc = io_uring_submit_and_wait(&w->ring, 1);
    }
    current = NULL;
    return NULL;
}

static int possible_cpus(void)
{
    /* The kernel makes one queue per possible CPU: "0-N" (or a list) in sysfs. */
    FILE *f = fopen("/sys/devices/system/cpu/possible", "r");
    int n = 0;
    if (f) {
        char line[256];
        if (fgets(line, sizeof(line), f)) {
            char *s = line;
            while (*s && *s != '\n') {
                long a = strtol(s, &s, 10), b = a;
                if (*s == '-')
                    b = strtol(s + 1, &s, 10);
                if (b + 1 > n)
                    n = (int)b + 1;
                if (*s == ',')
                    s++;
                else
                    break;
            }
        }
        fclose(f);
    }
    if (n <= 0)
        n = (int)sysconf(_SC_NPROCESSORS_CONF);
    return n > 0 ? n : 1;
}

static void worker_free(struct uring_worker *w)
{
    if (w->hdr)
        munmap(w->hdr, sizeof(*w->hdr));
    if (w->buf)
        munmap(w->buf, HEADROOM + PAYLOAD_SZ);
    if (w->ring.ring_fd > 0)
        io_uring_queue_exit(&w->ring);
}

/* Frees u and its workers' rings and buffers (their threads have ended, or never started). */
static void uring_free(hapi_uring *u)
{
    for (int i = 0; u->w && i < u->nworkers; i++)
        worker_free(&u->w[i]);
    free(u->w);
    if (u->stop_fd >= 0)
        close(u->stop_fd);
    pthread_mutex_destroy(&u->lock);
    pthread_cond_destroy(&u->cond);
    free(u);
}

int hapi_uring_start(struct fuse_session *se, int threads, hapi_uring **out, hapi_error *err)
{
    *out = NULL;
    hapi_uring *u = calloc(1, sizeof(*u));
    if (!u)
        return hapi_error_set(err, -ENOMEM, "io_uring: out of memory");
    u->se = se;
    u->fd = fuse_session_fd(se);
    u->nqueues = possible_cpus();
    /*
     * threads workers per queue: a cold read holds its worker until its batch
     * is computed, and readers may all run on one CPU (a storage tier in its
     * own cpuset, one sftp-server), so each queue needs what /dev/fuse had in
     * all. At most 256 in all (a node with many CPUs), at least 2 per queue.
     */
    int per = threads;
    if ((long)per * u->nqueues > 256)
        per = 256 / u->nqueues;
    u->nworkers = u->nqueues * (per < 2 ? 2 : per);
    pthread_mutex_init(&u->lock, NULL);
    pthread_cond_init(&u->cond, NULL);
    u->stop_fd = eventfd(0, EFD_CLOEXEC);
    u->w = calloc((size_t)u->nworkers, sizeof(*u->w));
    int rc = 0;
    if (u->stop_fd < 0 || !u->w) {
        rc = hapi_error_set(err, -ENOMEM, "io_uring: out of memory");
        goto fail;
    }
    for (int i = 0; i < u->nworkers; i++) {
        struct uring_worker *w = &u->w[i];
        w->u = u;
        w->qid = i % u->nqueues;
        w->ring.ring_fd = -1;
        w->hdr = mmap(NULL, sizeof(*w->hdr), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                      -1, 0);
        w->buf = mmap(NULL, HEADROOM + PAYLOAD_SZ, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (w->hdr == MAP_FAILED || w->buf == MAP_FAILED) {
            w->hdr = w->hdr == MAP_FAILED ? NULL : w->hdr;
            w->buf = w->buf == MAP_FAILED ? NULL : w->buf;
            rc = hapi_error_set(err, -ENOMEM, "io_uring: out of memory");
            goto fail;
        }
        w->iov[0] = (struct iovec){ w->hdr, sizeof(*w->hdr) };
        w->iov[1] = (struct iovec){ w->buf + HEADROOM, PAYLOAD_SZ };
        /* Four slots: the stop poll and one command, with room to spare. */
        int r = io_uring_queue_init(4, &w->ring, IORING_SETUP_SQE128 | IORING_SETUP_COOP_TASKRUN);
        if (r < 0) {
            w->ring.ring_fd = -1;
            rc = hapi_error_set(err, r, "io_uring: setting up a ring: %s", strerror(-r));
            goto fail;
        }
    }
    if ((rc = fuse_session_custom_io(se, &uring_io, u->fd)) < 0) {
        hapi_error_set(err, rc, "io_uring: libfuse refused a custom io: %s", strerror(-rc));
        goto fail;
    }
    /* Workers take no signals: libfuse's handlers must wake its own loop. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (int i = 0; i < u->nworkers; i++) {
        if (pthread_create(&u->w[i].tid, NULL, worker_main, &u->w[i]) != 0)
            break;
        u->w[i].started = 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    hapi_log(HAPI_LOG_INFO, "io_uring: %d workers on %d queues", u->nworkers, u->nqueues);
    *out = u;
    return 0;
fail:
    uring_free(u);
    return rc;
}

/* Sets *flag (u->initialized or u->stopping) and wakes the workers waiting to register. */
static void set_and_wake(hapi_uring *u, int *flag)
{
    pthread_mutex_lock(&u->lock);
    *flag = 1;
    pthread_cond_broadcast(&u->cond);
    pthread_mutex_unlock(&u->lock);
}

void hapi_uring_initialized(hapi_uring *u)
{
    if (u)
        set_and_wake(u, &u->initialized);
}

void hapi_uring_stats_get(const hapi_uring *u, hapi_uring_stats *s)
{
    memset(s, 0, sizeof(*s));
    if (!u)
        return;
    s->queues = u->nqueues;
    s->workers = u->nworkers;
    s->registered = atomic_load(&((hapi_uring *)u)->registered);
    s->active = s->registered == u->nworkers;
    s->requests = atomic_load_explicit(&((hapi_uring *)u)->requests, memory_order_relaxed);
}

void hapi_uring_stop(hapi_uring *u)
{
    if (!u)
        return;
    set_and_wake(u, &u->stopping);
    uint64_t one = 1;
    if (write(u->stop_fd, &one, sizeof(one)) < 0)
        hapi_log(HAPI_LOG_WARNING, "io_uring: waking the workers: %s", strerror(errno));
    for (int i = 0; i < u->nworkers; i++)
        if (u->w[i].started)
            pthread_join(u->w[i].tid, NULL);
    uring_free(u); /* closing the rings cancels the entries the kernel still holds */
}
