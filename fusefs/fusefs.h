/* fusefs.h — the hapifs daemon: mounts a feature view of an image tree. */
#ifndef HAPI_FUSEFS_H
#define HAPI_FUSEFS_H

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Runs the daemon: parses argv (`hapifs SOURCE MOUNTPOINT [-o OPTIONS] [-f]
 * [-d]`, or the mount helper's `mount.hapifs SOURCE MOUNTPOINT [-sfnv] [-o
 * OPTIONS]` when helper is nonzero), validates, mounts and serves until
 * unmounted or sent SIGTERM/SIGINT. Unless in the foreground it returns in
 * the calling process only once the mount is live or has failed, so that
 * mount(8) reports errors. Returns the process exit status.
 */
int hapi_fs_main(int argc, char *argv[], int helper);

#ifdef __cplusplus
}
#endif

#endif
