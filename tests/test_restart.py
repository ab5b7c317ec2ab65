"""A daemon killed (OOM killer, a bug) leaves "Transport endpoint is not connected"; a restart
serves the mount again with the same bytes, with no unmount by hand.

The restart is what examples/hapifs-feat.service makes systemd do (Restart=on-failure over
`hapifs -f`), and what an operator does with `mount` again.
"""
import errno
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import HAPIFS, Mount, is_mounted, need_hapifs, wait_gone
from test_permissions import USER, as_user, users_top
from test_throughput import make_tree


def feats(root, paths):
    return {p: (Path(root) / (p + ".feat")).read_bytes() for p in paths}


def served(mnt, timeout=120):
    """Waits until the mount answers (its split chosen); returns the seconds it took."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            (mnt / ".hapifs" / "config").read_bytes()
            return time.time() - t0
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"{mnt} not served after {timeout} s")


def dead(mnt):
    """The mount is dead (asked for a name the kernel has not cached: a request is made)."""
    with pytest.raises(OSError) as e:
        os.stat(mnt / "never-looked-up")
    # ENOTCONN, or ECONNABORTED once the kernel has aborted the connection; for the
    # first tens of ms after the kill ECANCELED, while io_uring tears down the dead
    # daemon's ring (seen once in CI, kernel 6.18: ECANCELED for 30 ms, then ENOTCONN)
    assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.ECANCELED), e.value
    return True


def test_a_killed_foreground_daemon_restarted_serves_the_same_bytes(tmp_path, models):
    need_hapifs()
    src, mnt, cache = tmp_path / "src", tmp_path / "mnt", tmp_path / "cache"
    paths = make_tree(src, classes=2, per_class=4, size=(40, 56), seed=5)
    mnt.mkdir()
    cache.mkdir()
    cmd = [str(HAPIFS), str(src), str(mnt), "-f", "-o",
           f"model={models()},cache={cache},prefetch=off,log={tmp_path / 'log'}"]
    daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        served(mnt)
        before = feats(mnt, paths)
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(timeout=30)
        assert dead(mnt)  # what users see until the restart

        t0 = time.time()
        daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # while it starts (its model loads), a reader hears that the daemon is gone, not that
        # its file is: the new mount goes beneath the dead one, which is detached only then
        seen = {}
        while time.time() - t0 < 120:
            try:
                os.stat(mnt / (paths[0] + ".feat"))
                break
            except OSError as e:
                seen[e.errno] = seen.get(e.errno, 0) + 1
            time.sleep(0.002)
        # never the directory beneath (ENOENT), not even for an instant
        assert errno.ENOENT not in seen, seen
        assert seen, "the poller saw no restart"
        served(mnt)
        after = feats(mnt, paths)
        restart_s = time.time() - t0
        print(f"served again {restart_s:.2f} s after the restart")
        assert after == before
        assert restart_s < 30
        stats = (mnt / ".hapifs" / "stats").read_text()
        assert '"computed": 0' in stats  # every feature came from the cache
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
    err = daemon.stderr.read().decode()
    assert "daemon had died; detached it" in err
    assert not is_mounted(mnt)


def test_mount_again_over_a_dead_mount(tmp_path, models):
    need_hapifs()
    src, cache = tmp_path / "src", tmp_path / "cache"
    paths = make_tree(src, classes=1, per_class=3, size=(40, 56), seed=6)
    cache.mkdir()
    opts = {"model": str(models()), "cache": str(cache), "prefetch": "off"}
    m = Mount(src, tmp_path / "mnt", dict(opts))
    before = feats(m.path, paths)
    os.kill(m.pid, signal.SIGKILL)
    assert wait_gone(m.pid)
    assert dead(m.path)
    # what an operator (or mount -a) does: the same command again
    r = subprocess.run(m.proc.args, capture_output=True, text=True, timeout=300)
    try:
        assert r.returncode == 0, r.stderr
        assert "daemon had died; detached it" in r.stderr
        assert feats(m.path, paths) == before
        # one mount there, not a live one stacked on a dead one
        lines = [l for l in Path("/proc/mounts").read_text().splitlines()
                 if l.split()[1] == str(m.path)]
        assert len(lines) == 1
    finally:
        pid = m.daemon_pid()
        subprocess.run(["fusermount3", "-u", str(m.path)], check=False)
        for _ in range(3):  # a dead mount left beneath, should the test have failed
            if is_mounted(m.path):
                subprocess.run(["umount", "-l", str(m.path)], check=False)
        assert wait_gone(pid)
    assert not is_mounted(m.path)


def test_mount_again_over_a_mount_nobody_answers(tmp_path, models):
    """A daemon killed while its io_uring ring held requests can leave its FUSE connection alive
    with nobody to answer it: the restart's check of the mount point waited for good (the
    two-tier soak: every compute restart after one such kill hung). Made here by stopping the
    daemon (SIGSTOP): the same command again takes the mount for dead after 10 s without an
    answer, aborts its connection, and serves."""
    need_hapifs()
    src, cache = tmp_path / "src", tmp_path / "cache"
    paths = make_tree(src, classes=1, per_class=3, size=(40, 56), seed=7)
    cache.mkdir()
    opts = {"model": str(models()), "cache": str(cache), "prefetch": "off"}
    m = Mount(src, tmp_path / "mnt", dict(opts))
    before = feats(m.path, paths)
    os.kill(m.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = subprocess.run(m.proc.args, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert "did not answer in 10 s" in r.stderr and took < 100, (took, r.stderr)
        assert feats(m.path, paths) == before
    finally:
        os.kill(m.pid, signal.SIGKILL)
        os.kill(m.pid, signal.SIGCONT)
        wait_gone(m.pid)
        pid = m.daemon_pid()
        subprocess.run(["fusermount3", "-u", str(m.path)], check=False)
        for _ in range(3):
            if is_mounted(m.path):
                subprocess.run(["umount", "-l", str(m.path)], check=False)
        if pid:
            wait_gone(pid)
    assert not is_mounted(m.path)


def test_a_dead_mount_it_cannot_detach_is_named_whole_at_a_long_path(models):
    """A mount over a dead mount that it may not detach says so, naming the mount point whole:
    the message once stopped at 255 bytes, mid-path. Made here at 3,000 characters of nested
    directories: root's mount there dies, and a user who may not detach it mounts again."""
    top = users_top("hapifs-long-")
    mnt = top.joinpath(*[f"{i:02d}" + "d" * 248 for i in range(12)])
    mnt.mkdir(parents=True)
    assert len(str(mnt)) > 3000
    try:
        src, cache, user_cache = top / "src", top / "cache", top / "user-cache"
        make_tree(src, classes=1, per_class=2, size=(40, 56), seed=8)
        model = top / "model.pt"
        shutil.copy(models(), model)
        user_cache.mkdir()
        shutil.chown(user_cache, USER)
        m = Mount(src, mnt, {"model": str(model), "cache": str(cache), "prefetch": "off",
                             "node": "none", "allow_other": None})
        os.kill(m.pid, signal.SIGKILL)
        assert wait_gone(m.pid)
        assert dead(mnt)
        cmd = " ".join(shlex.quote(a) for a in [
            str(HAPIFS), str(src), str(mnt), "-o",
            f"model={model},cache={user_cache},prefetch=off,node=none"])
        r = as_user(USER, cmd)
        assert r.returncode != 0, r.stderr
        whole = (f"hapifs: {mnt} is a hapifs mount whose daemon died, and it cannot be "
                 f"detached: Operation not permitted")
        assert whole in r.stderr.splitlines(), r.stderr[-600:]
    finally:
        for _ in range(3):
            if is_mounted(mnt):
                subprocess.run(["umount", "-l", str(mnt)], check=False)
        shutil.rmtree(top, ignore_errors=True)
    assert not is_mounted(mnt)
