"""The cache's life through a real mount: eviction under a small bound, freshness of changed,
replaced and deleted sources, kill -9 during warm-up, two mounts sharing one store, unusable cache
directories, `evict` on .hapifs/ctl, and the latency of a hit."""
import errno
import os
import random
import signal
import statistics
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import (HAPIFS, _smooth, daemon_pid, is_mounted, need_hapifs, reference_features,
                      wait_gone)
from test_throughput import make_tree, read_concurrently, wait_warm

ATTR_WAIT = 1.3  # past the daemon's 1 s attribute and entry timeouts


# ---------------------------------------------------------------------------------------------
# helpers

def feats(paths):
    return [p + ".feat" for p in paths]


def cache_stats(m):
    return m.ctl("stats")["cache"]


def ns_entries(m):
    return cache_stats(m)["namespace"]["entries"]


def ctl_write(m, text):
    """Writes one command to .hapifs/ctl in a single write(2): an error surfaces right here."""
    fd = os.open(m.path / ".hapifs" / "ctl", os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def ctl_error(m, text):
    """The errno of a refused command (fails the test if the command was accepted)."""
    with pytest.raises(OSError) as e:
        ctl_write(m, text)
    return e.value.errno


def read_uncached(path):
    """Reads a .feat with the kernel's page cache of it dropped first: the read reaches the daemon
    (a .feat is opened with keep_cache, so a re-read would otherwise not)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def load_npy(data):
    import io
    return np.load(io.BytesIO(data))


def assert_fp16_close(got, ref, what):
    # half precision: 11 significant bits, plus the fp32 drift of the frozen graph (as test_mount)
    np.testing.assert_allclose(got.astype(np.float32), ref, rtol=2e-3,
                               atol=2e-3 * np.abs(ref).max(), err_msg=what)


def wait_for(pred, timeout=5.0, step=0.05):
    end = time.time() + timeout
    while True:
        v = pred()
        if v or time.time() > end:
            return v
        time.sleep(step)


def run_mount(src, mnt, opts):
    return subprocess.run([str(HAPIFS), str(src), str(mnt), "-o", opts], capture_output=True,
                          text=True, timeout=120)


def assert_one_line_failure(r, mnt, *needles):
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0, r.stderr
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("hapifs: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, r.stderr)
    assert not is_mounted(mnt)
    assert daemon_pid(mnt) is None


# ---------------------------------------------------------------------------------------------
# 1. eviction keeps the store within cache_size and never fails a read

def test_eviction_bounds_the_store_and_reads_stay_exact(tmp_path, models, mounter):
    src = tmp_path / "src"
    # 600 images: ~0.7 MiB of 1,152-byte slots and ~0.15 MiB of LMDB, over a 1 MiB bound less
    # the room kept for LMDB to grow (a sixteenth and 64 pages): entries must be evicted
    paths = make_tree(src, classes=4, per_class=150, size=(64, 80), seed=11)
    names = feats(paths)
    n = len(names)
    archive = models()
    small = tmp_path / "small-cache"

    m1 = mounter(src, model=archive, cache=str(small), cache_size="1M")
    first = read_concurrently(m1, names, readers=4, seed=1)
    failed = {k: v for k, v in first.items() if not isinstance(v, bytes)}
    assert not failed, failed          # a full cache never fails a read
    st1 = m1.ctl("stats")
    f1, c1 = st1["feat"], st1["cache"]
    assert c1["size_limit"] == 1 << 20, c1
    assert c1["feat_size"] == 1152
    sample = c1["namespace"]["bytes"] // max(1, c1["namespace"]["entries"])
    assert sample >= 1024, c1  # 512 fp16 per entry, at least
    assert f1["computed"] == n and f1["failed"] == 0, f1
    assert c1["misses"] >= n and c1["hits"] == 0 and c1["stale"] == 0 and c1["bad"] == 0, c1
    # the working set did not fit: entries were evicted, and the books balance
    stored1 = n - f1["cache_put_failures"]
    assert c1["evictions"] > 0, c1
    assert c1["entries"] < n, c1
    assert c1["entries"] == stored1 - c1["evictions"], (f1, c1)
    assert c1["evictions_total"] == c1["evictions"], c1
    assert c1["namespace"]["entries"] == c1["entries"]
    # bounded: the stored bytes and the map's high-water mark are within the limit
    assert c1["entries"] * sample <= c1["size_limit"]
    assert c1["namespace"]["bytes"] <= c1["size_limit"]
    assert c1["bytes_used"] <= c1["size_limit"], c1
    m1.unmount()

    # second pass on a new mount (no page cache), another order: part hits, part recomputed
    m2 = mounter(src, model=archive, cache=str(small), cache_size="1M")
    second = read_concurrently(m2, names, readers=4, seed=2)
    bad = [k for k in names if second[k] != first[k]]
    assert not bad, f"{len(bad)} of {n} reads differ from the first pass, e.g. {bad[:3]}"
    st2 = m2.ctl("stats")
    f2, c2 = st2["feat"], st2["cache"]
    assert f2["failed"] == 0, f2
    assert c2["hits"] > 0, c2                       # what survived was served
    assert c2["hits"] <= c1["entries"]
    assert f2["hits"] + f2["misses"] == n, f2
    assert f2["computed"] == f2["misses"] and f2["computed"] > 0, f2
    stored2 = f2["computed"] - f2["cache_put_failures"]
    assert c2["entries"] == c1["entries"] + stored2 - c2["evictions"], (c1, f2, c2)
    assert c2["evictions_total"] == c1["evictions"] + c2["evictions"], (c1, c2)
    assert c2["bytes_used"] <= c2["size_limit"] and c2["entries"] < n, c2
    m2.unmount()

    # the expectation, computed apart: a big cache that holds everything
    big = mounter(src, model=archive, cache=str(tmp_path / "big-cache"), cache_size="64M")
    expect = read_concurrently(big, names, readers=4, seed=3)
    bad = [k for k in names if expect[k] != first[k]]
    assert not bad, f"{len(bad)} of {n} differ from a mount with a big cache, e.g. {bad[:3]}"
    cb = cache_stats(big)
    assert cb["evictions"] == 0 and cb["entries"] == n
    for p in paths[::150]:
        assert_fp16_close(load_npy(first[p + ".feat"]), reference_features(archive, src / p, 6), p)
    print(f"eviction: {n} images, size_limit {c1['size_limit']}; pass 1: evictions "
          f"{c1['evictions']}, puts refused {f1['cache_put_failures']}, entries left "
          f"{c1['entries']}, bytes_used {c1['bytes_used']}; pass 2: hits {f2['hits']}, recomputed "
          f"{f2['computed']}, evictions {c2['evictions']}, puts refused "
          f"{f2['cache_put_failures']}, entries {c2['entries']}; evictions_total "
          f"{c2['evictions_total']}")
    # A full store makes room by evicting; it does not refuse new features, while filling
    # nor after a remount and an epoch of hits (which once jammed it: eviction's own
    # transaction applied hundreds of logged accesses and overflowed the map).
    assert c2["evictions"] > 0, c2
    assert f1["cache_put_failures"] == 0 and f2["cache_put_failures"] == 0, \
        (f"the store refused {f1['cache_put_failures']} + {f2['cache_put_failures']} puts "
         f"(log: 'cache full: no room even to evict')")


# ---------------------------------------------------------------------------------------------
# 2. a modified, replaced or deleted source

def test_modified_replaced_deleted_sources(tmp_path, models, mounter):
    from PIL import Image
    src = tmp_path / "src"
    paths = make_tree(src, classes=2, per_class=4, size=(72, 96), seed=21)
    names = feats(paths)
    archive = models()
    m = mounter(src, model=archive, cache=str(tmp_path / "cache"))
    old = {k: (m.path / k).read_bytes() for k in names}
    assert ns_entries(m) == len(paths)
    rng = np.random.default_rng(99)
    modified, replaced, deleted = "class0/000.jpg", "class0/001.jpg", "class1/002.jpg"
    # in place: same inode, new bytes
    Image.fromarray(_smooth(72, 96, rng)).save(src / modified, quality=90)
    # a new file renamed over the old one (how rsync and most tools update)
    tmp = src / "class0" / "001.jpg.partial"
    Image.fromarray(_smooth(80, 64, rng)).save(tmp, format="JPEG", quality=90)
    os.replace(tmp, src / replaced)
    os.unlink(src / deleted)
    time.sleep(ATTR_WAIT)

    for p in (modified, replaced):
        data = (m.path / (p + ".feat")).read_bytes()
        assert data != old[p + ".feat"], f"{p}: the features of the old image were served"
        assert_fp16_close(load_npy(data), reference_features(archive, src / p, 6), p)
    st = m.ctl("stats")
    assert st["cache"]["stale"] >= 2, st["cache"]
    assert st["feat"]["computed"] == len(paths) + 2

    # the deleted one is gone from the mount and, once noticed, from the store
    with pytest.raises(FileNotFoundError):
        os.stat(m.path / (deleted + ".feat"))
    with pytest.raises(FileNotFoundError):
        open(m.path / (deleted + ".feat"), "rb")
    assert deleted + ".feat" not in os.listdir(m.path / "class1")
    got = wait_for(lambda: ns_entries(m) == len(paths) - 1, timeout=5)
    assert got, f"namespace entries {ns_entries(m)}, expected {len(paths) - 1} after the delete"

    # the rest is untouched and still served from the store
    hits = m.ctl("stats")["cache"]["hits"]
    changed = {p + ".feat" for p in (modified, replaced, deleted)}
    rest = [k for k in names if k not in changed]
    for k in rest:
        assert read_uncached(m.path / k) == old[k], k
    st = m.ctl("stats")
    assert st["cache"]["hits"] - hits == len(rest)
    assert st["feat"]["computed"] == len(paths) + 2
    # a remount sees the same: fresh bytes for the changed ones, without recomputing
    fresh = {p: (m.path / (p + ".feat")).read_bytes() for p in (modified, replaced)}
    m.unmount()
    m2 = mounter(src, model=archive, cache=str(tmp_path / "cache"))
    for p, data in fresh.items():
        assert (m2.path / (p + ".feat")).read_bytes() == data, p
    assert m2.ctl("stats")["feat"]["computed"] == 0
    assert ns_entries(m2) == len(paths) - 1


# ---------------------------------------------------------------------------------------------
# 3. kill -9 during warm-up, remount on the same store, again and again

def test_kill9_during_warmup_keeps_the_store_sound(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=5, per_class=30, size=(96, 128), seed=31)
    names = feats(paths)
    n = len(paths)
    # resnet18 at 224: ~30-60 samples/s on 2 cores, so a warm-up of 150 lasts 3-5 s and the
    # kills (0.25-0.7 s after each mount is up) land while features are computed and stored
    archive = models("resnet18", 224)
    cache = tmp_path / "kcache"
    mp = tmp_path / "kmnt"
    seed = int(os.environ.get("HAPI_TEST_SEED", time.time()))
    rng = random.Random(seed)
    committed = 0   # namespace entries seen just before the last kill: a lower bound
    mid_warm = 0
    history = []
    try:
        for it in range(5):
            m = mounter(src, mountpoint=mp, model=archive, cache=str(cache), warm=1)
            start = ns_entries(m)
            assert start >= committed, f"iteration {it}: {start} entries, {committed} before kill"
            delay = rng.uniform(0.25, 0.7)
            time.sleep(delay)
            st = m.ctl("stats")
            committed = st["cache"]["namespace"]["entries"]
            w = st["warm"]
            mid_warm += w["state"] != "done"
            history.append((round(delay, 2), start, committed, w["state"], w["done"]))
            os.kill(m.pid, signal.SIGKILL)
            assert wait_gone(m.pid), f"daemon {m.pid} survived SIGKILL"
            subprocess.run(["fusermount3", "-uz", str(mp)], check=True)
            assert not is_mounted(mp)
    finally:
        if is_mounted(mp):
            subprocess.run(["fusermount3", "-uz", str(mp)], check=False)
    print(f"kill -9 loop (seed {seed}): (delay s, entries at mount, entries at kill, warm state, "
          f"warm done) = {history}")
    assert mid_warm >= 3, f"only {mid_warm} of 5 kills landed during the warm-up: {history}"

    m = mounter(src, mountpoint=mp, model=archive, cache=str(cache), warm=1)
    assert ns_entries(m) >= committed
    w = wait_warm(m)
    assert w["total"] == n and w["done"] == n and w["skipped"] == 0, w
    assert w["cached"] >= committed, (w, committed)  # what was stored before the kills is served
    assert w["cached"] + w["computed"] == n, w
    got = {k: (m.path / k).read_bytes() for k in names}
    st = m.ctl("stats")
    assert st["feat"]["misses"] == 0 and st["feat"]["failed"] == 0, st["feat"]
    assert st["feat"]["computed"] == w["computed"], (st["feat"], w)
    assert st["feat"]["hits"] == n and st["cache"]["hits"] >= n, st
    assert st["cache"]["bad"] == 0, st["cache"]
    assert ns_entries(m) == n
    print(f"after the kills: {w['cached']} served from the store, {w['computed']} computed")

    # every .feat: byte-equal to a clean mount that was never killed, and close to torch
    clean = mounter(src, model=archive, cache=str(tmp_path / "clean-cache"))
    expect = read_concurrently(clean, names, readers=4)
    bad = [k for k in names if got[k] != expect[k]]
    assert not bad, f"{len(bad)} .feat differ from a clean mount, e.g. {bad[:3]}"
    for p in paths[::15]:
        assert_fp16_close(load_npy(got[p + ".feat"]), reference_features(archive, src / p, 6), p)


# ---------------------------------------------------------------------------------------------
# 4. two mounts at once on one store: other split, other source tree

def test_two_mounts_share_one_store(tmp_path, models, mounter):
    src_a, src_b = tmp_path / "srcA", tmp_path / "srcB"
    # the same relative paths in both trees, different images: only the namespace tells them apart
    paths_a = make_tree(src_a, classes=2, per_class=15, size=(64, 80), seed=41)
    paths_b = make_tree(src_b, classes=3, per_class=8, size=(80, 64), seed=42)
    archive = models()
    cache = tmp_path / "shared"
    a = mounter(src_a, model=archive, cache=str(cache), cache_size="64M", split="layer3")
    b = mounter(src_b, model=archive, cache=str(cache), cache_size="64M")
    assert a.ctl("config")["cache"]["namespace"] != b.ctl("config")["cache"]["namespace"]
    assert ns_entries(a) == 0 and ns_entries(b) == 0

    results = {}

    def run(name, mount, names):
        results[name] = read_concurrently(mount, names, readers=6, seed=len(name))

    threads = [threading.Thread(target=run, args=("a", a, feats(paths_a) * 2)),
               threading.Thread(target=run, args=("bb", b, feats(paths_b) * 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ra, rb = results["a"], results["bb"]
    for k in feats(paths_a):
        assert isinstance(ra[k], bytes), (k, ra[k])
        arr = load_npy(ra[k])
        assert arr.shape == (256, 4, 4) and arr.dtype == np.float16
    for k in feats(paths_b):
        assert isinstance(rb[k], bytes), (k, rb[k])
        assert load_npy(rb[k]).shape == (512,)
    for p in paths_a[::7]:
        assert_fp16_close(load_npy(ra[p + ".feat"]), reference_features(archive, src_a / p, 4),
                          "A " + p)
    for p in paths_b[::6]:
        assert_fp16_close(load_npy(rb[p + ".feat"]), reference_features(archive, src_b / p, 6),
                          "B " + p)
    sa, sb = cache_stats(a), cache_stats(b)
    assert sa["namespace"]["entries"] == len(paths_a), sa
    assert sb["namespace"]["entries"] == len(paths_b), sb
    assert sa["entries"] == sb["entries"] == len(paths_a) + len(paths_b)
    assert a.ctl("stats")["feat"]["computed"] == len(paths_a)
    assert b.ctl("stats")["feat"]["computed"] == len(paths_b)

    # evict all on A leaves B's entries alone
    ctl_write(a, "evict all\n")
    assert ns_entries(a) == 0
    assert ns_entries(b) == len(paths_b)
    assert cache_stats(a)["entries"] == len(paths_b)
    computed_b = b.ctl("stats")["feat"]["computed"]
    for k in feats(paths_b):
        assert read_uncached(b.path / k) == rb[k], k
    assert b.ctl("stats")["feat"]["computed"] == computed_b  # all hits
    for k in feats(paths_a):
        assert read_uncached(a.path / k) == ra[k], k          # recomputed, same bytes
    assert a.ctl("stats")["feat"]["computed"] == 2 * len(paths_a)
    assert ns_entries(a) == len(paths_a) and ns_entries(b) == len(paths_b)


# ---------------------------------------------------------------------------------------------
# 5. unusable cache directories (test_mount checks read-only and garbage without reset)

def test_cache_reset_and_unusable_cache_dirs(tmp_path, models, mounter):
    need_hapifs()
    from PIL import Image
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    rng = np.random.default_rng(51)
    for i in range(3):
        Image.fromarray(_smooth(64, 80, rng)).save(src / "c" / f"{i}.jpg", quality=90)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    archive = models()
    bad = tmp_path / "badcache"
    bad.mkdir()
    garbage = os.urandom(20000)
    (bad / "data.mdb").write_bytes(garbage)

    # without reset (absent or 0): refused, with the way out named, and the store left as it was
    for opts in (f"model={archive},cache={bad}", f"model={archive},cache={bad},cache_reset=0"):
        r = run_mount(src, mnt, opts)
        assert_one_line_failure(r, mnt, "cache_reset=1")
        assert (bad / "data.mdb").read_bytes() == garbage
    r = run_mount(src, mnt, f"model={archive},cache={bad},cache_reset=yes")
    assert_one_line_failure(r, mnt, "cache_reset")

    # with cache_reset=1: a fresh store, and it works
    m = mounter(src, model=archive, cache=str(bad), cache_reset=1)
    c = cache_stats(m)
    assert c["entries"] == 0 and c["namespace"]["entries"] == 0, c
    first = {}
    for i in range(3):
        p = f"c/{i}.jpg"
        first[p] = (m.path / (p + ".feat")).read_bytes()
        assert_fp16_close(load_npy(first[p]), reference_features(archive, src / p, 6), p)
    assert ns_entries(m) == 3
    assert (bad / "data.mdb").read_bytes() != garbage
    # the old file is kept aside, not silently destroyed (cache.h: data.mdb.reset)
    assert (bad / "data.mdb.reset").read_bytes() == garbage
    m.unmount()
    # the new store is a proper one: a mount without reset opens it and hits
    m2 = mounter(src, model=archive, cache=str(bad))
    for p, data in first.items():
        assert (m2.path / (p + ".feat")).read_bytes() == data
    assert m2.ctl("stats")["feat"]["computed"] == 0
    m2.unmount()

    # cache_reset=1 does not paper over a cache "directory" that is a file
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = run_mount(src, mnt, f"model={archive},cache={afile},cache_reset=1")
    assert_one_line_failure(r, mnt, "not a directory", str(afile))
    assert afile.read_text() == "x"

    # nor over a read-only one, empty or holding garbage
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ro)], check=True)
    try:
        (ro / "data.mdb").write_bytes(garbage)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        r = run_mount(src, mnt, f"model={archive},cache={ro}")
        assert_one_line_failure(r, mnt, str(ro))
        assert "read-only" in r.stderr or "cache_reset=1" in r.stderr, r.stderr
        r = run_mount(src, mnt, f"model={archive},cache={ro},cache_reset=1")
        assert_one_line_failure(r, mnt, str(ro), "read-only")  # a reset is impossible: say why
        assert (ro / "data.mdb").read_bytes() == garbage
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        r = run_mount(src, mnt, f"model={archive},cache={ro},cache_reset=1")
        assert_one_line_failure(r, mnt, "read-only", str(ro))
    finally:
        subprocess.run(["umount", str(ro)], check=True)


# ---------------------------------------------------------------------------------------------
# 6. evict on .hapifs/ctl

def test_ctl_evict(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=3, per_class=6, size=(64, 80), seed=61)
    names = feats(paths)
    n = len(paths)
    (src / "notes.txt").write_text("not an image\n")
    m = mounter(src, model=models(), cache=str(tmp_path / "cache"))
    first = {k: (m.path / k).read_bytes() for k in names}
    assert ns_entries(m) == n
    assert m.ctl("stats")["feat"]["computed"] == n

    def computed():
        return m.ctl("stats")["feat"]["computed"]

    # refused forms change nothing
    for bad in ["evict a b\n", "evict all class0\n", "evict ../etc\n", "evict class0/../../x\n",
                "evict " + "x" * 5000 + "\n"]:
        assert ctl_error(m, bad) == errno.EINVAL, bad
    for missing in ["evict nosuch\n", "evict class0/999.jpg\n"]:
        assert ctl_error(m, missing) == errno.ENOENT, missing
    assert ns_entries(m) == n

    # one image
    ctl_write(m, "evict class0/001.jpg\n")
    assert ns_entries(m) == n - 1
    assert cache_stats(m)["entries"] == n - 1
    c0 = computed()
    assert read_uncached(m.path / "class0/001.jpg.feat") == first["class0/001.jpg.feat"]
    assert computed() == c0 + 1
    assert read_uncached(m.path / "class0/002.jpg.feat") == first["class0/002.jpg.feat"]
    assert computed() == c0 + 1  # not evicted: a hit
    assert ns_entries(m) == n

    # a directory (a leading slash and a trailing one are fine)
    ctl_write(m, "evict /class1/\n")
    assert ns_entries(m) == n - 6
    c0 = computed()
    for k in names:
        assert read_uncached(m.path / k) == first[k], k
    assert computed() == c0 + 6
    assert ns_entries(m) == n

    # everything: `evict all` and plain `evict`
    ctl_write(m, "evict all\n")
    assert ns_entries(m) == 0 and cache_stats(m)["entries"] == 0
    c0 = computed()
    for k in names[:5]:
        assert read_uncached(m.path / k) == first[k], k
    assert computed() == c0 + 5 and ns_entries(m) == 5
    ctl_write(m, "evict\n")
    assert ns_entries(m) == 0
    # evicting what is not cached is fine
    ctl_write(m, "evict class2\n")
    assert ns_entries(m) == 0
    assert "evict" in (m.path / ".hapifs" / "ctl").read_text()
    assert m.ctl("stats")["cache"]["evictions"] == 0  # removals on request are not evictions


# ---------------------------------------------------------------------------------------------
# 7. the latency of a hit, seen by a client and by the daemon

def test_hit_latency(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=4, per_class=25, size=(64, 80), seed=71)
    names = feats(paths)
    archive = models()
    cache = tmp_path / "cache"
    m = mounter(src, model=archive, cache=str(cache), warm=1)
    w = wait_warm(m)
    assert w["computed"] == len(paths)
    m.unmount()

    m = mounter(src, model=archive, cache=str(cache))
    order = list(names)
    random.Random(7).shuffle(order)
    times, sizes = [], set()
    for k in order:
        p = str(m.path / k)
        t0 = time.perf_counter_ns()
        fd = os.open(p, os.O_RDONLY)
        data = os.read(fd, 1 << 16)
        os.close(fd)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        sizes.add(len(data))
    assert sizes == {1152}
    st = m.ctl("stats")
    c = st["cache"]
    assert st["feat"]["computed"] == 0 and c["hits"] >= len(paths), c
    med = statistics.median(times)
    p90 = sorted(times)[int(0.9 * len(times))]
    print(f"hit latency over {len(times)} cached .feat: client open+read+close median "
          f"{med:.0f} us, p90 {p90:.0f} us; daemon cache hit_latency_us {c['hit_latency_us']:.1f}, "
          f"feat hit_latency_us {st['feat'].get('hit_latency_us', float('nan')):.1f}")
    assert 0 < c["hit_latency_us"] < 50_000, c
    assert 0 < med < 50_000
