/* daemon.c — the daemon's life: validate, fork, load, mount, report to the waiting parent, serve, unmount. */
#include "fusefs.h"
#include "fs.h"
#include "hapi.h"
#include "log.h"
#include "options.h"
#include "uring.h"

#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef MOVE_MOUNT_BENEATH
#define MOVE_MOUNT_BENEATH 0x00000200 /* Linux 6.5; glibc 2.36 does not name it */
#endif

/*
 * Start-up runs in two processes unless -f is given. The parent validates the
 * options (so that a bad option fails at once), forks, and waits on a pipe.
 * The child creates the libtorch runtime and the LMDB environment (neither
 * survives a fork), mounts, and only then writes "OK" or the error to the
 * pipe. So `mount` returns when the mount is live, and prints what failed.
 */

static void report(int fd, const char *prog, int code, const char *message)
{
    if (fd < 0) {
        if (code < 0)
            fprintf(stderr, "%s: %s\n", prog, message);
        return;
    }
    char line[HAPI_ERROR_MESSAGE_MAX + 16]; /* "ERROR " and a whole message */
    int len = code < 0 ? snprintf(line, sizeof(line), "ERROR %s\n", message)
                       : snprintf(line, sizeof(line), "OK\n");
    if (len > (int)sizeof(line) - 1)
        len = (int)sizeof(line) - 1;
    ssize_t w = write(fd, line, (size_t)len);
    (void)w;
}

/* Removes the staging links (mount_beneath()) that dead daemons of mountpoint left. */
static void forget_staging_links(const char *mountpoint)
{
    DIR *d = opendir("/run/hapifs");
    if (!d)
        return;
    for (struct dirent *e; (e = readdir(d));) {
        char target[PATH_MAX];
        if (strncmp(e->d_name, "mount-", 6) != 0)
            continue;
        ssize_t n = readlinkat(dirfd(d), e->d_name, target, sizeof(target) - 1);
        if (n < 0)
            continue;
        target[n] = '\0';
        if (strcmp(target, mountpoint) == 0)
            unlinkat(dirfd(d), e->d_name, 0);
    }
    closedir(d);
}

/*
 * Mounts se in place of the dead mount of ours at opt->mountpoint with no
 * moment where the directory beneath shows (where every file is missing:
 * ENOENT to a reader, who should hear that the daemon is gone): se is mounted
 * at a staging directory, moved beneath the dead mount (MOVE_MOUNT_BENEATH),
 * and only then is the dead one detached. Readers see the dead mount until
 * that instant and this one from it. The staging directory is a private bind
 * of itself, since a mount whose parent is shared cannot move. libfuse
 * unmounts at exit by the path it mounted at: the staging path is left a
 * symbolic link to the mount point, which umount2 follows; the caller removes
 * it (staging, PATH_MAX) after fuse_session_unmount. Needs root and Linux
 * 6.5. Returns 0; or -errno with se not mounted and staging "" (the caller
 * detaches the dead mount, then mounts).
 */
static int mount_beneath(struct fuse_session *se, const hapi_fs_options *opt, char *staging)
{
    int rc = 0;
    staging[0] = '\0';
    if (geteuid() != 0)
        return -EPERM;
    if (mkdir("/run/hapifs", 0755) < 0 && errno != EEXIST)
        return -errno;
    forget_staging_links(opt->mountpoint);
    snprintf(staging, PATH_MAX, "/run/hapifs/mount-XXXXXX");
    if (!mkdtemp(staging)) {
        rc = -errno;
        goto out_name;
    }
    if (mount(staging, staging, NULL, MS_BIND, NULL) < 0) {
        rc = -errno;
        goto out_dir;
    }
    if (mount(NULL, staging, NULL, MS_PRIVATE, NULL) < 0) {
        rc = -errno;
        goto out_bind;
    }
    if (fuse_session_mount(se, staging) < 0) {
        rc = -EIO;
        goto out_bind;
    }
    if (move_mount(AT_FDCWD, staging, AT_FDCWD, opt->mountpoint, MOVE_MOUNT_BENEATH) < 0) {
        rc = -errno;
        fuse_session_unmount(se);
        goto out_bind;
    }
    if ((rc = hapi_fs_detach_dead_mount(opt)) < 0) {
        /* the dead mount stays on top of ours: nobody could reach this one */
        hapi_log(HAPI_LOG_ERROR, "%s: cannot detach the dead mount above the new one: %s",
                 opt->mountpoint, strerror(-rc));
    }
    umount2(staging, MNT_DETACH);
    rmdir(staging);
    if (symlink(opt->mountpoint, staging) < 0)
        hapi_log(HAPI_LOG_WARNING, "%s: %s; unmount %s by hand at exit", staging, strerror(errno),
                 opt->mountpoint);
    return rc;
out_bind:
    umount2(staging, MNT_DETACH);
out_dir:
    rmdir(staging);
out_name:
    staging[0] = '\0';
    return rc;
}

/*
 * Mounts se at opt->mountpoint; over a dead mount of ours, beneath it where
 * that can be done, else after detaching it. Returns 0, or < 0 with err.
 */
static int mount_session(struct fuse_session *se, const hapi_fs_options *opt, char *staging,
                         hapi_error *err)
{
    int rc;
    if (opt->dead_mount) {
        hapi_fs_abort_dead_mount(opt);
        if ((rc = mount_beneath(se, opt, staging)) == 0)
            return 0;
        if (!staging[0]) {
            hapi_log(HAPI_LOG_INFO, "%s: cannot mount beneath the dead mount (%s): detaching "
                     "it first", opt->mountpoint, strerror(-rc));
            rc = hapi_fs_detach_dead_mount(opt);
        }
        /* else mounted beneath, but the dead mount stays above */
        if (rc < 0)
            return hapi_error_set(err, rc, "%s is a hapifs mount whose daemon died, and it "
                                  "cannot be detached: %s", opt->mountpoint, strerror(-rc));
    }
    if (fuse_session_mount(se, opt->mountpoint) < 0)
        return hapi_error_set(err, -EIO, "cannot mount on %s (is /dev/fuse usable?)",
                              opt->mountpoint);
    return 0;
}

/* In the parent: waits for the child's word and turns it into an exit status. */
static int wait_for_child(int fd, pid_t child, const char *prog)
{
    char line[HAPI_ERROR_MESSAGE_MAX + 16]; /* report()'s line */
    size_t used = 0;
    while (used < sizeof(line) - 1) {
        ssize_t r = read(fd, line + used, sizeof(line) - 1 - used);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        used += (size_t)r;
        if (memchr(line, '\n', used))
            break;
    }
    line[used] = '\0';
    close(fd);
    if (strncmp(line, "OK", 2) == 0)
        return 0;
    if (strncmp(line, "ERROR ", 6) == 0) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = '\0';
        fprintf(stderr, "%s: %s\n", prog, line + 6);
    } else {
        int status = 0;
        waitpid(child, &status, 0);
        if (WIFSIGNALED(status))
            fprintf(stderr, "%s: the daemon died during start-up (signal %d)\n", prog,
                    WTERMSIG(status));
        else
            fprintf(stderr, "%s: the daemon exited during start-up\n", prog);
    }
    waitpid(child, NULL, WNOHANG);
    return 1;
}

static void detach_stdio(void)
{
    int fd = open("/dev/null", O_RDWR);
    if (fd >= 0) {
        dup2(fd, STDIN_FILENO);
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        if (fd > STDERR_FILENO)
            close(fd);
    }
    if (chdir("/") < 0)
        hapi_log(HAPI_LOG_WARNING, "chdir /: %s", strerror(errno));
}

/*
 * Unless -f: forks, the parent waiting for the child's word (wait_for_child()), the child
 * in a session of its own with *status_fd the pipe to report on. Returns 1 in the parent
 * or on a failure, with *exit_code what the process exits with; 0 in the daemon.
 */
static int fork_daemon(const char *prog, int *status_fd, int *exit_code)
{
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) < 0) {
        fprintf(stderr, "%s: pipe: %s\n", prog, strerror(errno));
        return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "%s: fork: %s\n", prog, strerror(errno));
        close(pipefd[0]);
        close(pipefd[1]);
        return 1;
    }
    if (pid > 0) {
        close(pipefd[1]);
        *exit_code = wait_for_child(pipefd[0], pid, prog);
        return 1;
    }
    close(pipefd[0]);
    *status_fd = pipefd[1];
    setsid();
    return 0;
}

/*
 * In the daemon: the log, the filesystem's layers, the FUSE session (*se, the caller's to
 * destroy), the mount, io_uring; then the mount serves. A failure is reported on status_fd
 * (or stderr) and returned (< 0); with the session mounted, its signal handlers stay
 * installed for the caller to remove.
 */
static int start_serving(hapi_fs *fs, hapi_fs_options *opt, struct fuse_session **se,
                         char *staging, int status_fd, const char *prog)
{
    hapi_error err = { 0 };
    int rc;
    if ((rc = hapi_log_open(opt->log_path, opt->foreground, opt->debug)) < 0) {
        hapi_error_set(&err, rc, "log %s: %s", opt->log_path, strerror(-rc));
        report(status_fd, prog, rc, err.message);
        return rc;
    }
    opt->serving_gate = 1; /* hapi_fs_serving() below, once mounted */
    if ((rc = hapi_fs_init(fs, opt, &err)) < 0) {
        hapi_log(HAPI_LOG_ERROR, "%s", err.message);
        report(status_fd, prog, rc, err.message);
        return rc;
    }
    *se = fuse_session_new(&opt->fuse_args, &hapi_fs_ops, sizeof(hapi_fs_ops), fs);
    if (!*se) {
        report(status_fd, prog, -EINVAL, "cannot create the FUSE session (bad FUSE option?)");
        return -EINVAL;
    }
    fs->se = *se;
    if (fuse_set_signal_handlers(*se) < 0) {
        report(status_fd, prog, -EINVAL, "cannot install signal handlers");
        return -EINVAL;
    }
    if ((rc = mount_session(*se, opt, staging, &err)) < 0) {
        report(status_fd, prog, rc, err.message);
        fuse_remove_signal_handlers(*se); /* a session mounted beneath ends with the process */
        return rc;
    }
    hapi_fs_probe_epochs(fs);
    if (opt->uring && hapi_uring_available()) {
        hapi_error uerr = { 0 };
        if (hapi_uring_start(*se, opt->threads, &fs->uring, &uerr) < 0)
            hapi_log(HAPI_LOG_WARNING, "%s; requests go through /dev/fuse", uerr.message);
    }
    hapi_fs_serving(fs);
    return 0;
}

/* Serves until the unmount or a signal; returns the exit code. */
static int serve_until_unmount(struct fuse_session *se, const hapi_fs_options *opt)
{
    struct fuse_loop_config *loop = fuse_loop_cfg_create();
    if (!loop) {
        hapi_log(HAPI_LOG_ERROR, "out of memory");
        return 1;
    }
    fuse_loop_cfg_set_clone_fd(loop, 0);
    fuse_loop_cfg_set_max_threads(loop, (unsigned)opt->threads);
    fuse_loop_cfg_set_idle_threads(loop, (unsigned)(opt->threads > 4 ? opt->threads / 4 : 1));
    int rc = fuse_session_loop_mt(se, loop);
    hapi_log(HAPI_LOG_INFO, "unmounting %s", opt->mountpoint);
    fuse_loop_cfg_destroy(loop);
    return rc == 0 ? 0 : 1;
}

int hapi_fs_main(int argc, char *argv[], int helper)
{
    const char *prog = helper ? "mount.hapifs" : "hapifs";
    hapi_fs_options opt;
    hapi_error err = { 0 };
    hapi_fs fs = { 0 };
    struct fuse_session *se = NULL;
    int status_fd = -1;
    int exit_code = 1;
    char staging[PATH_MAX] = ""; /* mount_beneath()'s link to the mount point */

    if (hapi_fs_options_parse(argc, argv, helper, &opt, &err) < 0) {
        fprintf(stderr, "%s: %s\n", prog, err.message);
        goto out;
    }
    if (opt.show_help || opt.show_version || opt.fake) { /* mount -f: nothing to mount */
        if (opt.show_help)
            hapi_fs_usage(prog);
        else if (opt.show_version)
            printf("hapifs %s (libfuse %s)\n", HAPI_VERSION, fuse_pkgversion());
        exit_code = 0;
        goto out;
    }
    if (!opt.foreground && fork_daemon(prog, &status_fd, &exit_code))
        goto out;
    if (start_serving(&fs, &opt, &se, staging, status_fd, prog) < 0)
        goto out;
    report(status_fd, prog, 0, NULL);
    if (status_fd >= 0) {
        close(status_fd);
        status_fd = -1;
        detach_stdio();
    }
    exit_code = serve_until_unmount(se, &opt);
    hapi_fs_stop_watching(&fs); /* its thread notifies the kernel through se */
    fs.se = NULL; /* nothing may notify the kernel any more */
    fuse_session_unmount(se);
    hapi_uring_stop(fs.uring); /* after the unmount: its last requests may use the ring */
    fs.uring = NULL;
    fuse_remove_signal_handlers(se);
out:
    if (staging[0])
        unlink(staging);
    if (status_fd >= 0)
        close(status_fd);
    if (se)
        fuse_session_destroy(se);
    hapi_fs_destroy(&fs);
    hapi_fs_options_free(&opt);
    hapi_log_close();
    return exit_code;
}
