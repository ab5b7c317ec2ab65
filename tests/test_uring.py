"""FUSE over io_uring (fusefs/uring.c): where the kernel offers it, requests are served through
per-CPU ring queues instead of /dev/fuse, by the same operations, with the same answers.

These tests need a kernel with the transport (Linux >= 6.14) and the fuse module's enable_uring
set (tools/install-deps sets it); elsewhere they are skipped with the reason. The rest of the
suite then runs through the ring too, as every mount uses it by default.
"""
import errno
import fcntl
import os
import subprocess
import termios
from pathlib import Path

import numpy as np
import pytest

from conftest import PYTHON, reference_features
from test_throughput import make_tree

PARAM = Path("/sys/module/fuse/parameters/enable_uring")
PACK = ".hapifs-pack.npy"


def need_uring():
    if not PARAM.exists():
        pytest.skip(f"this kernel ({os.uname().release}) has no FUSE over io_uring")
    if PARAM.read_text().strip() not in ("Y", "1"):
        pytest.skip(f"{PARAM} is off (tools/install-deps turns it on)")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("uring-src")
    return root, make_tree(root, classes=2, per_class=6, size=(64, 80))


def uring(m):
    return m.ctl("stats")["uring"]


def assert_close(got, ref):
    np.testing.assert_allclose(got.astype(np.float32), ref, rtol=2e-3,
                               atol=2e-3 * np.abs(ref).max())


def test_every_request_type_is_answered_through_the_ring(tree, models, mounter):
    need_uring()
    src, paths = tree
    model = models()
    m = mounter(src, model=model, split=4, show_raw=1)
    u = uring(m)
    assert u["queues"] >= os.cpu_count()
    assert u["workers"] >= 2 * u["queues"]
    assert u["registered"] == u["workers"], u
    assert m.ctl("config")["runtime"]["uring"] is True
    before = u["requests"]

    # lookups, listings, reads of computed features, exact as ever
    assert sorted(os.listdir(m.path)) == ["class0", "class1"]
    for p in paths:
        assert_close(np.load(m.path / (p + ".feat")), reference_features(model, src / p, 4))
    # a raw image (show_raw): a reply made from a file descriptor, which the ring must copy
    assert (m.path / paths[0]).read_bytes() == (src / paths[0]).read_bytes()
    # a pack: replies of many pages
    pack = np.load(m.path / "class0" / PACK)
    assert pack.shape[0] == 6
    assert np.array_equal(pack[0], np.load(m.path / (paths[0] + ".feat")))
    # errors come back as errors: an ioctl the daemon does not serve, a write, a missing name
    fd = os.open(m.path / (paths[0] + ".feat"), os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            fcntl.ioctl(fd, termios.TCGETS, b"\0" * 64)
        assert e.value.errno == errno.ENOTTY
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:  # without opens, refused at the write (test_mount)
        fd = os.open(m.path / (paths[0] + ".feat"), os.O_WRONLY)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
    assert e.value.errno == errno.EROFS
    with pytest.raises(FileNotFoundError):
        os.stat(m.path / "class0" / "nothing.jpg.feat")
    os.statvfs(m.path)

    served = uring(m)["requests"] - before
    counts = m.ctl("stats")["requests"]
    assert served >= len(paths), (served, counts)
    # the control files are read through the ring too, and a write to ctl takes effect
    fd = os.open(m.path / ".hapifs" / "ctl", os.O_WRONLY)
    try:
        assert os.write(fd, b"split 5\n") == 8
    finally:
        os.close(fd)
    assert m.ctl("config")["split"]["index"] == 5
    assert_close(np.load(m.path / (paths[1] + ".feat")), reference_features(model, src / paths[1], 5))


def test_each_cpu_has_its_queue(tree, models, mounter):
    """A reader on each CPU is answered: every queue has workers (a queue without them would
    leave that CPU's readers waiting forever)."""
    need_uring()
    src, paths = tree
    m = mounter(src, model=models())
    for p in paths:  # computed once
        (m.path / (p + ".feat")).read_bytes()
    for cpu in sorted(os.sched_getaffinity(0)):
        before = uring(m)["requests"]
        code = ("import os, sys\n"
                f"os.sched_setaffinity(0, {{{cpu}}})\n"
                "for p in sys.argv[1:]:\n"
                "    with open(p, 'rb') as f: f.read()\n")
        subprocess.run([PYTHON, "-c", code] + [str(m.path / (p + ".feat")) for p in paths],
                       check=True, timeout=60)
        # each open(2) from Python sends an isatty() ioctl, which no cache answers
        assert uring(m)["requests"] - before >= len(paths), cpu


def test_uring_0_serves_through_dev_fuse(tree, models, mounter):
    src, paths = tree
    model = models()
    m = mounter(src, model=model, uring=0)
    m.ctl("config")  # waits for the first split
    split = m.ctl("config")["split"]["index"]
    assert_close(np.load(m.path / (paths[0] + ".feat")), reference_features(model, src / paths[0], split))
    assert uring(m) == {"queues": 0, "workers": 0, "registered": 0, "requests": 0}
    assert m.ctl("config")["runtime"]["uring"] is False


def test_stopping_with_readers_on_the_ring(tree, models, mounter):
    """Unmounting while readers keep reading through the ring ends the daemon cleanly: the
    workers stop, the kernel's entries are cancelled, and no reader hangs."""
    need_uring()
    src, paths = tree
    m = mounter(src, model=models())
    files = [str(m.path / (p + ".feat")) for p in paths]
    code = ("import sys, time\n"
            "end = time.time() + 20\n"
            "while time.time() < end:\n"
            "    for p in sys.argv[1:]:\n"
            "        try:\n"
            "            open(p, 'rb').read()\n"
            "        except OSError:\n"
            "            sys.exit(0)\n"
            "sys.exit(3)\n")
    readers = [subprocess.Popen([PYTHON, "-c", code] + files) for _ in range(4)]
    try:
        while uring(m)["requests"] < 200:
            pass
        subprocess.run(["umount", "-l", str(m.path)], check=True)
        for r in readers:
            assert r.wait(timeout=30) in (0, 3)
    finally:
        for r in readers:
            r.kill()
    from conftest import wait_gone
    assert wait_gone(m.pid, timeout=30), "the daemon did not exit"
