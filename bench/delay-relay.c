/*
 * delay-relay.c — the delay line of bench/hapifs-cluster where the kernel has no netem.
 *
 *   delay-relay HOST PORT DELAY_SECONDS
 *
 * ssh's ProxyCommand: carries stdin to a TCP connection to HOST:PORT and that connection back
 * to stdout, holding every chunk DELAY_SECONDS in each direction before passing it on, so that
 * a request and its answer take twice the delay more. It runs on the compute tier's CPU, as
 * ssh does, while a network's delay costs no CPU: one thread and a poll loop, 16-20 us of CPU
 * a chunk here. (The Python relay it replaces, a thread per direction, took 94 us a chunk, and
 * the compute tier 1.5-3 ms more CPU per file read through sshfs at 1 ms RTT than at none.)
 * Not installed; a measuring tool, not a product.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK_MAX (256 * 1024)   /* bytes read at once */
#define HIGH_WATER (64u << 20)   /* bytes held per direction before reading waits */

/* A chunk read and not yet written whole: due is when it may go. Owned by its direction. */
struct chunk {
    struct chunk *next;
    uint64_t due;
    size_t len, off;
    unsigned char data[];
};

/* One direction: from in to out, its chunks in order of arrival (and so of due time). */
struct dir {
    int in, out;
    struct chunk *head, *tail;
    size_t held;
    int eof;  /* in is at its end: when the queue is empty, finish out */
    int done; /* out finished */
    int is_socket_out;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static int connect_to(const char *host, const char *port)
{
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *res, *ai;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc != 0) {
        fprintf(stderr, "delay-relay: %s: %s\n", host, gai_strerror(rc));
        return -1;
    }
    int fd = -1;
    for (ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0)
            continue;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
            break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        fprintf(stderr, "delay-relay: cannot connect to %s port %s: %s\n", host, port,
                strerror(errno));
    return fd;
}

/* Reads what in has into a new chunk due delay_ns from now. 0, or -1 when in failed. */
static int pull(struct dir *d, unsigned char *buf, uint64_t delay_ns)
{
    ssize_t n = read(d->in, buf, CHUNK_MAX);
    if (n < 0)
        return errno == EAGAIN || errno == EINTR ? 0 : -1;
    if (n == 0) {
        d->eof = 1;
        return 0;
    }
    struct chunk *c = malloc(sizeof(*c) + (size_t)n);
    if (!c) {
        fprintf(stderr, "delay-relay: out of memory\n");
        return -1;
    }
    memcpy(c->data, buf, (size_t)n);
    c->len = (size_t)n;
    c->off = 0;
    c->next = NULL;
    c->due = now_ns() + delay_ns;
    if (d->tail)
        d->tail->next = c;
    else
        d->head = c;
    d->tail = c;
    d->held += (size_t)n;
    return 0;
}

/* Writes the due chunks out as far as out takes them. 0, or -1 when out failed. */
static int push(struct dir *d, uint64_t now)
{
    while (d->head && d->head->due <= now) {
        struct chunk *c = d->head;
        ssize_t n = write(d->out, c->data + c->off, c->len - c->off);
        if (n < 0)
            return errno == EAGAIN || errno == EINTR ? 0 : -1;
        c->off += (size_t)n;
        if (c->off < c->len)
            return 0;
        d->head = c->next;
        if (!d->head)
            d->tail = NULL;
        d->held -= c->len;
        free(c);
    }
    return 0;
}

/* When in has ended and everything went out: finish out (half-close or close). */
static void finish(struct dir *d)
{
    if (d->done || !d->eof || d->head)
        return;
    if (d->is_socket_out)
        shutdown(d->out, SHUT_WR);
    else
        close(d->out);
    d->done = 1;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: delay-relay HOST PORT DELAY_SECONDS\n");
        return 2;
    }
    char *end;
    double delay = strtod(argv[3], &end);
    if (*end || !(delay >= 0) || delay > 10) {
        fprintf(stderr, "delay-relay: DELAY_SECONDS must be 0..10: %s\n", argv[3]);
        return 2;
    }
    uint64_t delay_ns = (uint64_t)(delay * 1e9);
    signal(SIGPIPE, SIG_IGN);
    int sock = connect_to(argv[1], argv[2]);
    if (sock < 0)
        return 1;
    int one = 1;
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (set_nonblock(0) < 0 || set_nonblock(1) < 0 || set_nonblock(sock) < 0) {
        fprintf(stderr, "delay-relay: fcntl: %s\n", strerror(errno));
        return 1;
    }
    unsigned char *buf = malloc(CHUNK_MAX);
    if (!buf)
        return 1;
    struct dir up = { .in = 0, .out = sock, .is_socket_out = 1 };
    struct dir down = { .in = sock, .out = 1 };
    struct dir *dirs[2] = { &up, &down };
    /* The connection is over when the storage side has closed and all of it is delivered. */
    while (!down.done) {
        struct pollfd pfd[4];
        struct dir *of[4];
        int want_in[4];
        int n = 0;
        uint64_t now = now_ns(), next = UINT64_MAX;
        for (int i = 0; i < 2; i++) {
            struct dir *d = dirs[i];
            if (!d->eof && d->held < HIGH_WATER) {
                pfd[n] = (struct pollfd){ .fd = d->in, .events = POLLIN };
                of[n] = d, want_in[n++] = 1;
            }
            if (d->head) {
                if (d->head->due <= now) {
                    pfd[n] = (struct pollfd){ .fd = d->out, .events = POLLOUT };
                    of[n] = d, want_in[n++] = 0;
                } else if (d->head->due < next) {
                    next = d->head->due;
                }
            }
        }
        struct timespec ts, *tp = NULL;
        if (next != UINT64_MAX) {
            uint64_t wait = next - now;
            ts.tv_sec = (time_t)(wait / 1000000000u);
            ts.tv_nsec = (long)(wait % 1000000000u);
            tp = &ts;
        }
        if (ppoll(pfd, (nfds_t)n, tp, NULL) < 0) {
            if (errno == EINTR)
                continue;
            fprintf(stderr, "delay-relay: poll: %s\n", strerror(errno));
            return 1;
        }
        for (int i = 0; i < n; i++) {
            if (!pfd[i].revents || !want_in[i])
                continue; /* a writable out: the pushes below write to it */
            if (pull(of[i], buf, delay_ns) < 0) {
                /* the storage side went away: nothing more can arrive for stdout */
                if (of[i] == &down)
                    return 0;
                of[i]->eof = 1; /* stdin failed: end the way up as at its end */
            }
        }
        now = now_ns();
        for (int i = 0; i < 2; i++) {
            if (push(dirs[i], now) < 0)
                return 0;
            finish(dirs[i]);
        }
    }
    free(buf);
    return 0;
}
