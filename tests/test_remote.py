"""The compute-side mount (-o remote) over storage mounts: features fetched as packs into a local cache."""
import errno
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import Mount, abort_connection, daemon_pid, need_hapifs, wait_gone
from test_cache_life import ctl_error, ctl_write
from test_throughput import make_tree

PACK = ".hapifs-pack.npy"
INDEX = ".hapifs-pack.json"


@pytest.fixture
def storage(tmp_path, mounter, models):
    """storage(name, classes, per_class, **opts) -> (source dir, Mount, relative image paths)."""
    def make(name="a", classes=2, per_class=6, seed=1, **opts):
        src = tmp_path / f"src-{name}"
        paths = make_tree(src, classes=classes, per_class=per_class, size=(40, 56), seed=seed)
        opts.setdefault("model", models())
        opts.setdefault("prefetch", "off")
        opts.setdefault("cache", str(tmp_path / f"cache-{name}"))
        m = mounter(src, tmp_path / f"storage-{name}", **opts)
        m.ctl("config")  # waits for the first split
        return src, m, paths
    return make


def remote(mounter, tmp_path, sources, cache="rcache", mountpoint=None, **opts):
    """A compute-side mount of sources. The tests of how features travel (packs, indexes,
    sources, freshness) compare its bytes with the storage mount's: they give features=split."""
    opts.setdefault("cache", str(tmp_path / cache))
    return mounter(":".join(str(s) for s in sources),
                   mountpoint or tmp_path / f"remote-{len(list(tmp_path.glob('remote-*')))}",
                   remote=None, **opts)


def wait_until(predicate, timeout=60):
    """Polls predicate until it is true; fails after timeout seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def drop_pages(root, paths):
    """Drops the kernel's copies of the files, so that the next reads ask the daemon."""
    for p in paths:
        fd = os.open(Path(root) / (p + ".feat"), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def feats(root, paths):
    return {p: (Path(root) / (p + ".feat")).read_bytes() for p in paths}


def test_remote_serves_the_storage_features_in_packs(tmp_path, storage, mounter):
    src, st, paths = storage()
    r = remote(mounter, tmp_path, [st.path], features="split")
    # the same tree, as listed
    assert sorted(os.listdir(r.path)) == sorted(os.listdir(st.path))
    assert sorted(os.listdir(r.path / "class0")) == sorted(os.listdir(st.path / "class0"))
    # sizes exact before anything is fetched
    for p in paths:
        assert os.stat(r.path / (p + ".feat")).st_size == os.stat(st.path / (p + ".feat")).st_size
    assert r.ctl("stats")["remote"]["pack_bytes"] == 0

    got = feats(r.path, paths)
    stats = r.ctl("stats")
    # the storage side served packs, not a read per file
    sst = st.ctl("stats")
    assert sst["feat"]["reads"] == 0
    assert sst["pack"]["opens"] == 2
    assert stats["remote"]["packs"] == 2
    assert stats["feat"]["fetched"] == len(paths)
    assert stats["feat"]["misses"] == 2 or stats["feat"]["misses"] >= 2
    assert got == feats(st.path, paths)
    # link bytes: the packs and their indexes, close to the features' own bytes
    row = len(next(iter(got.values())))
    assert stats["remote"]["pack_bytes"] <= 1.3 * row * len(paths) + 4096
    # the storage side's config and model, served through
    cfg = r.ctl("config")
    scfg = st.ctl("config")
    assert cfg["split"]["index"] == scfg["split"]["index"]
    assert cfg["split"]["namespace"] == scfg["split"]["namespace"]
    assert cfg["remote"]["sources"][0]["path"] == str(st.path)
    assert cfg["mountpoint"] == str(r.path)
    assert (r.path / ".hapifs" / "model").read_bytes() == (st.path / ".hapifs" / "model").read_bytes()
    # the pack files are not shown on the compute side
    assert PACK not in os.listdir(r.path / "class0")


def test_a_second_job_moves_no_feature_bytes(tmp_path, storage, mounter):
    src, st, paths = storage()
    r1 = remote(mounter, tmp_path, [st.path])
    first = feats(r1.path, paths)
    r1.unmount()
    r2 = remote(mounter, tmp_path, [st.path])
    assert feats(r2.path, paths) == first
    stats = r2.ctl("stats")
    assert stats["remote"]["pack_bytes"] == 0
    assert stats["feat"]["hits"] == len(paths) and stats["feat"]["misses"] == 0


def test_concurrent_misses_in_a_directory_join_one_fetch(tmp_path, storage, mounter):
    from concurrent.futures import ThreadPoolExecutor
    src, st, paths = storage(classes=1, per_class=24)
    r = remote(mounter, tmp_path, [st.path], features="split")
    with ThreadPoolExecutor(12) as ex:
        got = dict(zip(paths, ex.map(lambda p: (r.path / (p + ".feat")).read_bytes(), paths)))
    assert got == feats(st.path, paths)
    assert r.ctl("stats")["remote"]["packs"] == 1
    assert st.ctl("stats")["pack"]["opens"] == 1


def test_a_miss_that_races_the_store_of_its_row_fetches_nothing_more(tmp_path, storage, mounter):
    """Readers that miss while a chunk is being stored look again rather than fetch it again."""
    from concurrent.futures import ThreadPoolExecutor
    src, st, paths = storage(classes=1, per_class=48)
    want = feats(st.path, paths)  # warm on the storage side: packs stream at once
    r = remote(mounter, tmp_path, [st.path], features="split")
    rounds = 8
    with ThreadPoolExecutor(16) as ex:
        for i in range(rounds):
            # the last round's fetch stores its rows after it delivered them: an evict before
            # that store ends would leave them to this round, which then fetches nothing (seen
            # once in a suite: 7 packs of 8)
            wait_until(lambda: r.ctl("stats")["remote"]["fetches_running"] == 0 and
                       r.ctl("stats")["remote"]["fetches_queued"] == 0)
            ctl_write(r, "evict all")
            drop_pages(r.path, paths)  # and the kernel's copies (keep_cache): every read misses
            order = paths[i % 7:] + paths[:i % 7]
            got = dict(zip(order, ex.map(lambda p: (r.path / (p + ".feat")).read_bytes(), order)))
            assert got == want
    assert r.ctl("stats")["remote"]["packs"] == rounds


def test_union_of_two_storage_nodes(tmp_path, storage, mounter):
    src_a, a, pa = storage("a", classes=2, per_class=4, seed=1)
    src_b, b, _ = storage("b", classes=3, per_class=4, seed=2)
    # b holds class2 only: a hash-sharded layout
    shutil.rmtree(src_b / "class0")
    shutil.rmtree(src_b / "class1")
    pb = [f"class2/{n[:-5]}" for n in sorted(os.listdir(b.path / "class2"))]
    r = remote(mounter, tmp_path, [a.path, b.path], features="split")
    assert sorted(os.listdir(r.path)) == ["class0", "class1", "class2"]
    assert feats(r.path, pa) == feats(a.path, pa)
    assert feats(r.path, pb) == feats(b.path, pb)
    srcs = r.ctl("stats")["remote"]["sources"]
    assert [s["packs"] for s in srcs] == [2, 1]
    assert all(s["state"] == "ok" for s in srcs)


def test_freshness_a_changed_image_and_a_split_change(tmp_path, storage, mounter):
    from PIL import Image
    src, st, paths = storage(classes=1, per_class=4)
    r = remote(mounter, tmp_path, [st.path], refresh=0, features="split")
    p = paths[0]
    before = (r.path / (p + ".feat")).read_bytes()
    # the image is replaced on the storage node: the compute side must not serve the old features
    arr = np.full((40, 56, 3), 200, np.uint8)
    Image.fromarray(arr).save(src / p, quality=90)
    time.sleep(1.2)  # the kernels' attribute caches (1 s) on both mounts
    new = (st.path / (p + ".feat")).read_bytes()
    assert new != before
    assert (r.path / (p + ".feat")).read_bytes() == new
    # the storage side changes its split: new opens see the new shape
    (st.path / ".hapifs" / "ctl").write_text("split 2\n")
    time.sleep(1.2)
    want = np.load(st.path / (paths[1] + ".feat"))
    got = np.load(r.path / (paths[1] + ".feat"))
    assert got.shape == want.shape and np.array_equal(got, want)
    assert r.ctl("config")["split"]["index"] == 2


def test_a_kept_index_is_checked_by_its_version(tmp_path, storage, mounter):
    from PIL import Image
    src, st, paths = storage(classes=1, per_class=4)
    index = st.path / "class0" / INDEX
    head = '{"format":"hapifs-pack/1","version":"'
    pending = index.read_text()
    assert pending.startswith(head) and '"pending"' in pending
    r = remote(mounter, tmp_path, [st.path], refresh=1, features="split")
    assert feats(r.path, paths) == feats(st.path, paths)
    # the statuses changed, the version did not
    cached = index.read_text()
    assert '"pending"' not in cached
    assert json.loads(cached)["version"] == json.loads(pending)["version"]
    s0 = r.ctl("stats")["remote"]["sources"][0]
    time.sleep(1.3)
    assert (r.path / (paths[0] + ".feat")).read_bytes() == (st.path / (paths[0] + ".feat")).read_bytes()
    s1 = r.ctl("stats")["remote"]["sources"][0]
    # checked by a 4 KiB read, not read again
    assert s1["index_checks"] > s0["index_checks"]
    assert s1["index_reads"] == s0["index_reads"]
    assert s1["index_bytes"] - s0["index_bytes"] <= 4096 * (s1["index_checks"] - s0["index_checks"])
    # a changed image changes the version: read again, new features served
    Image.fromarray(np.full((40, 56, 3), 30, np.uint8)).save(src / paths[1], quality=90)
    time.sleep(1.3)
    new = (st.path / (paths[1] + ".feat")).read_bytes()
    assert json.loads(index.read_text())["version"] != json.loads(cached)["version"]
    assert (r.path / (paths[1] + ".feat")).read_bytes() == new
    assert r.ctl("stats")["remote"]["sources"][0]["index_reads"] > s1["index_reads"]


def test_a_source_that_is_not_a_storage_mount_is_refused(tmp_path, storage, mounter):
    src, st, paths = storage(classes=1, per_class=3)
    plain = tmp_path / "plain"
    (plain / "class9").mkdir(parents=True)
    # alone: the mount fails with one clear line
    with pytest.raises(RuntimeError, match="not a hapifs storage mount"):
        remote(mounter, tmp_path, [plain])
    # beside a good one: down (a storage daemon restarting looks the same), the other serves
    r = remote(mounter, tmp_path, [plain, st.path], features="split")
    states = [s["state"] for s in r.ctl("stats")["remote"]["sources"]]
    assert states == ["down", "ok"]
    assert feats(r.path, paths) == feats(st.path, paths)
    assert "not a hapifs storage mount" in (r.path / ".hapifs" / "errors").read_text()
    # while it is down, a name only it might have is EIO, not ENOENT
    with pytest.raises(OSError) as e:
        os.stat(r.path / "class0" / "nothing.jpg.feat")
    assert e.value.errno == errno.EIO
    # it becomes a storage mount (its daemon back): served from then on, not refused for good
    shutil.rmtree(plain)
    fake_storage(tmp_path, st, "class0", name="plain")
    ctl_write(r, "evict all")
    wait_until(lambda: os.listdir(r.path / "class0") and
               r.ctl("stats")["remote"]["sources"][0]["state"] == "ok")  # at its next use
    drop_pages(r.path, paths)  # the kernel's pages of these files go: the daemon is asked
    assert feats(r.path, paths) == feats(st.path, paths)
    assert r.ctl("stats")["remote"]["sources"][0]["packs"] >= 1


def test_a_source_of_another_model_is_refused_another_split_is_not(tmp_path, storage, mounter,
                                                                   models):
    """The nodes of one dataset serve one model, each at the split its policy chose: a node at
    another split is a source like the others (its directories' indexes say their namespace),
    one of another model is refused."""
    src_a, a, paths_a = storage("a", classes=1, per_class=2)
    src_b, b, paths_b = storage("b", classes=2, per_class=2, seed=2)
    src_c, c, paths_c = storage("c", classes=2, per_class=2, seed=3, model=models(seed=7))
    ctl_write(a, "split 2")
    ctl_write(b, "split 3")
    wait_until(lambda: a.ctl("config")["split"]["index"] == 2 and
               b.ctl("config")["split"]["index"] == 3)
    r = remote(mounter, tmp_path, [a.path, b.path], features="split")
    assert [s["state"] for s in r.ctl("stats")["remote"]["sources"]] == ["ok", "ok"]
    only_b = [p for p in paths_b if p.startswith("class1/")]
    assert feats(r.path, paths_a) == feats(a.path, paths_a)  # class0: the first source's
    assert feats(r.path, only_b) == feats(b.path, only_b)
    r2 = remote(mounter, tmp_path, [a.path, c.path], cache="rcache2")
    assert [s["state"] for s in r2.ctl("stats")["remote"]["sources"]] == ["ok", "refused"]
    assert "another model digest" in (r2.path / ".hapifs" / "errors").read_text()
    with pytest.raises(FileNotFoundError):
        os.stat(r2.path / (paths_c[-1] + ".feat"))  # class1 is only c's


def fake_storage(tmp_path, st, d, name="fake"):
    """A plain directory that looks like a storage mount: its config, and d's index and pack
    (no model: what a remote mount serves from it is features=split)."""
    fake = tmp_path / name
    (fake / ".hapifs").mkdir(parents=True)
    (fake / ".hapifs" / "config").write_bytes((st.path / ".hapifs" / "config").read_bytes())
    (fake / d).mkdir(parents=True)
    (fake / d / INDEX).write_bytes((st.path / d / INDEX).read_bytes())
    (fake / d / PACK).write_bytes((st.path / d / PACK).read_bytes())
    return fake


def test_a_torn_pack_is_refused_and_never_cached(tmp_path, storage, mounter):
    src, st, paths = storage(classes=1, per_class=4)
    fake = fake_storage(tmp_path, st, "class0")
    pack = fake / "class0" / PACK
    pack.write_bytes(pack.read_bytes()[:-100])
    r = remote(mounter, tmp_path, [fake], features="split")
    with pytest.raises(OSError) as e:
        (r.path / (paths[0] + ".feat")).read_bytes()
    assert e.value.errno == errno.EIO
    stats = r.ctl("stats")
    assert stats["cache"]["entries"] == 0
    assert stats["remote"]["sources"][0]["fetch_failures"] >= 1
    assert "torn" in (r.path / ".hapifs" / "errors").read_text()


def test_pack_files_read_through_and_cut_short_are_eio(tmp_path, storage, mounter):
    """A storage daemon that dies under a reader of its pack files leaves them empty or cut
    through its network filesystem: read through a remote mount they fail with EIO, never end
    early as if whole."""
    src, st, paths = storage(classes=1, per_class=4)
    fake = fake_storage(tmp_path, st, "class0")
    pack, index = fake / "class0" / PACK, fake / "class0" / INDEX
    whole_pack, whole_index = pack.read_bytes(), index.read_bytes()
    r = remote(mounter, tmp_path, [fake], features="split")
    got = r.path / "class0"
    assert (got / PACK).read_bytes() == whole_pack and (got / INDEX).read_bytes() == whole_index
    for f, cut in ((pack, len(whole_pack) // 2), (pack, 100), (pack, 0),
                   (index, len(whole_index) // 2), (index, 0)):
        f.write_bytes((whole_pack if f == pack else whole_index)[:cut])
        with pytest.raises(OSError) as e:
            (got / f.name).read_bytes()
        assert e.value.errno == errno.EIO, (f.name, cut)
        f.write_bytes(whole_pack if f == pack else whole_index)
    errors = (r.path / ".hapifs" / "errors").read_text()
    assert f"ended at {len(whole_pack) // 2} bytes" in errors
    assert "ends before its header" in errors and "has no pack header" in errors
    assert "index read through its source is not whole" in errors
    assert (got / PACK).read_bytes() == whole_pack and (got / INDEX).read_bytes() == whole_index


def test_a_corrupt_or_hostile_index_is_refused(tmp_path, storage, mounter):
    src, st, paths = storage(classes=1, per_class=4)
    fake = fake_storage(tmp_path, st, "class0")
    index = json.loads((fake / "class0" / INDEX).read_text())
    index["entries"][0]["name"] = "../../etc/passwd.jpg"
    (fake / "class0" / INDEX).write_text(json.dumps(index))
    r = remote(mounter, tmp_path, [fake], features="split")
    # the directory cannot be served: EIO, and the reason in errors; nothing is read outside
    with pytest.raises(OSError) as e:
        (r.path / (paths[1] + ".feat")).read_bytes()
    assert e.value.errno == errno.EIO
    errors = (r.path / ".hapifs" / "errors").read_text()
    assert "index refused" in errors and "bad name" in errors
    assert r.ctl("stats")["remote"]["packs"] == 0


def test_an_undecodable_image_fails_alone(tmp_path, storage, mounter):
    src, st, paths = storage(classes=1, per_class=4, prefetch="off")
    (src / "class0" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    r = remote(mounter, tmp_path, [st.path], features="split")
    with pytest.raises(OSError) as e:
        (r.path / "class0" / "bad.jpg.feat").read_bytes()
    assert e.value.errno == errno.EIO
    assert feats(r.path, paths) == feats(st.path, paths)
    assert r.ctl("stats")["remote"]["sources"][0]["rows_failed"] >= 1


def test_a_dead_source_gives_eio_and_recovers(tmp_path, storage, mounter, models):
    src, st, paths = storage(classes=2, per_class=3)
    r = remote(mounter, tmp_path, [st.path], refresh=0, features="split")
    assert feats(r.path, paths[:3]) == feats(st.path, paths[:3])  # class0 fetched
    os.kill(st.pid, signal.SIGKILL)
    wait_gone(st.pid)
    with pytest.raises(OSError) as e:
        (r.path / (paths[3] + ".feat")).read_bytes()
    assert e.value.errno == errno.EIO
    assert any(s["last_error"] for s in r.ctl("stats")["remote"]["sources"])
    # the storage node is restarted over the same mountpoint: while it is unmounted, the
    # remote sees the empty directory under it (and must not keep it as the source's root)
    subprocess.run(["fusermount3", "-u", "-z", str(st.path)], check=False)
    # the images exist: a source down is EIO, never ENOENT (nor a read of 0 bytes), for a
    # .feat read before (its directory's index was kept) and one never read
    for p in (paths[4], paths[0]):
        with pytest.raises(OSError) as e:
            (r.path / (p + ".feat")).read_bytes()
        assert e.value.errno == errno.EIO, (p, e.value)
    with pytest.raises(OSError) as e:  # its pack files too (ENOENT before)
        (r.path / "class0" / PACK).read_bytes()
    assert e.value.errno == errno.EIO, e.value
    # and the commands on its paths: EIO, not "no such file or directory" (ENOENT before)
    assert ctl_error(r, "warm class1") == errno.EIO
    assert ctl_error(r, f"evict {paths[0]}") == errno.EIO
    assert "a source that may have it is down" in (r.path / ".hapifs" / "errors").read_text()
    back = Mount(src, st.path, dict(st.options))
    try:
        back.ctl("config")
        for p in paths[3:]:
            assert (r.path / (p + ".feat")).read_bytes() == (back.path / (p + ".feat")).read_bytes()
    finally:
        back.unmount()


def test_a_missing_name_after_a_source_came_back_is_enoent(tmp_path, storage, mounter):
    """A source that died is opened again by the first reader after it came back, however long
    after: a name missing then is ENOENT. (Every reopen was taken for a filesystem mounted again
    over the directory beneath, so such a reader's missing names were EIO: the two-tier soak's
    final pass, 60 s after a storage restart, read deleted names as EIO.)"""
    src, st, paths = storage(classes=1, per_class=3)
    r = remote(mounter, tmp_path, [st.path], refresh=0, features="split")
    os.kill(st.pid, signal.SIGKILL)
    wait_gone(st.pid)
    with pytest.raises(OSError) as e:
        (r.path / (paths[0] + ".feat")).read_bytes()
    assert e.value.errno == errno.EIO
    # the same command again, over the dead mount, as systemd does it
    again = subprocess.run(st.proc.args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    st.ctl("config")
    time.sleep(1)  # nobody reads the remote meanwhile
    with pytest.raises(OSError) as e:
        (r.path / "class0" / "gone.jpg.feat").read_bytes()
    assert e.value.errno == errno.ENOENT, e.value
    assert (r.path / (paths[0] + ".feat")).read_bytes() == \
        (st.path / (paths[0] + ".feat")).read_bytes()

def test_a_name_missed_where_the_source_was_before_a_remount_is_not_enoent(tmp_path, storage,
                                                                          mounter, monkeypatch):
    """A name missed in what a source's path showed then (the empty directory beneath a storage
    mount being restarted), and judged only after another mount came over it, is EIO, never
    ENOENT: the new mount being a storage mount says nothing of where the name was missed. (A
    reader held up between its miss and that check read existing images as ENOENT in the two-tier
    soak, at the end of sshfs remounts.)"""
    hold = tmp_path / "hold"
    monkeypatch.setenv("HAPIFS_TEST_HOLD_MISS", str(hold))
    src, st, paths = storage(classes=2, per_class=2)
    r = remote(mounter, tmp_path, [st.path], refresh=0, features="split")
    # both directories known to the kernel: the held reader waits in a lookup in class0, the
    # other reader's lookups are in class1 (the kernel serializes lookups in one directory)
    feats(r.path, [paths[0], paths[2]])
    os.kill(st.pid, signal.SIGKILL)
    wait_gone(st.pid)
    subprocess.run(["fusermount3", "-u", "-z", str(st.path)], check=False)
    hold.touch()
    got = {}

    def read():
        try:
            got["bytes"] = len((r.path / (paths[1] + ".feat")).read_bytes())
        except OSError as e:
            got["errno"] = e.errno
    reader = threading.Thread(target=read)
    reader.start()
    wait_until(lambda: (tmp_path / "hold.held").exists())  # it missed, in the empty directory
    back = Mount(src, st.path, dict(st.options))
    try:
        back.ctl("config")
        # another reader opens the new mount (no miss: not held), and the source's last
        # reopen is older than the 0.2 s a reopen makes a source count as down
        assert (r.path / (paths[3] + ".feat")).read_bytes() == \
            (back.path / (paths[3] + ".feat")).read_bytes()
        time.sleep(0.5)
        hold.unlink()
        reader.join(60)
        assert got == {"errno": errno.EIO}, got

        def served():
            try:
                return (r.path / (paths[1] + ".feat")).read_bytes() == \
                    (back.path / (paths[1] + ".feat")).read_bytes()
            except OSError as e:
                assert e.errno == errno.EIO, e  # a failed index is kept a moment
                return False
        wait_until(served)
    finally:
        if hold.exists():
            hold.unlink()
        back.unmount()


def test_a_name_that_is_not_utf8_is_served_with_its_directory(tmp_path, storage, mounter):
    """An image whose name is not UTF-8 (Latin-1, as old archives have) is listed in its
    directory's index (as name_hex) and served through the compute side, and so is the rest of
    its directory (the index could not be written: every image there was EIO)."""
    src, st, paths = storage(classes=1, per_class=2)
    odd = b"caf\xe9.jpg"
    shutil.copy(src / paths[0], os.fsencode(src / "class0") + b"/" + odd)
    wait_until(lambda: odd + b".feat" in os.listdir(os.fsencode(st.path / "class0")))
    index = json.loads((st.path / "class0" / INDEX).read_bytes())
    assert [e.get("name_hex") for e in index["entries"]] == [None, None, odd.hex()], index
    r = remote(mounter, tmp_path, [st.path], refresh=0, features="split")
    assert feats(r.path, paths) == feats(st.path, paths)
    feat = odd + b".feat"
    assert feat in os.listdir(os.fsencode(r.path / "class0"))
    with open(os.fsencode(r.path / "class0") + b"/" + feat, "rb") as f:
        got = f.read()
    with open(os.fsencode(st.path / "class0") + b"/" + feat, "rb") as f:
        assert got == f.read()


def cosine(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_features_freeze_are_the_freeze_points_whatever_the_split(tmp_path, storage, mounter):
    """features=freeze: the compute side runs the storage side's stages [split, freeze) on the
    rows it fetches, so an unmodified script reads the freeze point's features whatever the
    storage side's split (the stem, a middle stage, the freeze point itself), and a split
    changed under it changes no shape and no byte it was served."""
    src, ref, paths = storage(name="ref", classes=2, per_class=3, split="pool", dtype="fp32")
    freeze = json.loads((ref.path / ".hapifs" / "config").read_text())["split"]
    assert freeze["index"] == freeze["freeze"]  # the reference cuts at the freeze point
    want = {p: np.load(ref.path / (p + ".feat")) for p in paths}
    for split, dtype, precision, tol in (("stem", "fp32", "fp32", 1 - 1e-9),
                                         ("layer2", "fp16", "fp32", 0.9999),
                                         ("layer1", "fp32", "bf16", 0.995),
                                         ("pool", "fp32", "fp32", 1 - 1e-9)):
        _, st, _ = storage(name=f"{split}-{dtype}", classes=2, per_class=3, split=split,
                           dtype=dtype)
        r = remote(mounter, tmp_path, [st.path], cache=f"rcache-{split}", features="freeze",
                   refresh=0, precision=precision)
        for p in paths:
            got = np.load(r.path / (p + ".feat"))
            assert got.shape == want[p].shape, (split, got.shape)
            assert got.dtype == np.dtype(np.float16 if dtype == "fp16" else np.float32)
            assert cosine(got, want[p]) >= tol, (split, p, cosine(got, want[p]))
            if os.environ.get("HAPI_TEST_VERBOSE"):
                print(f"features=freeze from {split} ({dtype}, {precision}): {p} cosine "
                      f"{cosine(got, want[p]):.10f}, max rel "
                      f"{np.max(np.abs(got - want[p])) / np.max(np.abs(want[p])):.2e}")
        # kept in its cache directory, by digest: a remount does not fetch it again (at the
        # freeze point nothing runs here: not fetched at all)
        kept = list((tmp_path / f"rcache-{split}").glob("model-*.pt"))
        assert len(kept) == (0 if split == "pool" else 1), (split, kept)
        computed = r.ctl("stats")["feat"]["computed"]
        assert computed == (0 if split == "pool" else len(paths)), (split, computed)
        # what a script sees: the freeze point (train.py runs no trunk); what is sent: the split
        config = r.ctl("config")
        assert config["split"]["index"] == config["split"]["freeze"] == freeze["freeze"]
        assert config["split"]["shape"] == list(want[paths[0]].shape)
        assert config["features"]["storage_split"]["stage"] == split, config["features"]
        assert config["split"]["feat_size"] == (r.path / (paths[0] + ".feat")).stat().st_size
        if split == "stem":
            stats = r.ctl("stats")
            first = feats(r.path, paths)
            ctl_write(st, "split layer3")  # under the script: the same shape, the same bytes
            time.sleep(1.5)
            drop_pages(r.path, paths)
            assert feats(r.path, paths) == first
            assert r.ctl("stats")["feat"]["misses"] == stats["feat"]["misses"], "refetched"


def test_a_remote_mount_serves_the_freeze_points_features_by_default(tmp_path, storage, mounter):
    """Without features=, a .feat is the freeze point's whatever the storage side's split, and
    precision= and torch_threads= say how the stages before it run here. At the freeze point
    itself the storage side's bytes pass as they are: nothing is computed here, and the model
    is loaded only once the storage side cuts before it."""
    _, ref, paths = storage(name="ref", classes=1, per_class=3, split="pool")
    _, st, _ = storage(name="early", classes=1, per_class=3, split="layer2")
    want = {p: np.load(ref.path / (p + ".feat")) for p in paths}
    r = remote(mounter, tmp_path, [st.path], precision="bf16", torch_threads=1)
    for p in paths:
        got = np.load(r.path / (p + ".feat"))
        assert got.shape == want[p].shape and got.dtype == np.float16, (p, got.shape, got.dtype)
        assert cosine(got, want[p]) >= 0.995, (p, cosine(got, want[p]))
    config = r.ctl("config")
    assert config["split"]["index"] == config["split"]["freeze"] == \
        ref.ctl("config")["split"]["index"]
    assert config["features"]["mode"] == "freeze", config["features"]
    assert config["features"]["storage_split"]["stage"] == "layer2", config["features"]
    assert r.ctl("stats")["feat"]["computed"] == len(paths)
    at_freeze = remote(mounter, tmp_path, [ref.path], cache="rcache-ref", refresh=0)
    assert feats(at_freeze.path, paths) == feats(ref.path, paths)
    assert at_freeze.ctl("stats")["feat"]["computed"] == 0
    # nothing to run here: the model is neither fetched nor loaded...
    assert at_freeze.ctl("config")["features"]["model_loaded"] is False
    assert not list((tmp_path / "rcache-ref").glob("model-*"))
    # ...until the storage side cuts earlier: then it is, and the script sees the same shape
    ctl_write(ref, "split layer2")
    wait_until(lambda: ref.ctl("config")["split"]["stage"] == "layer2")
    ctl_write(at_freeze, "evict")  # else its cache, which holds every split's, answers
    drop_pages(at_freeze.path, paths)
    for p in paths:
        got = np.load(at_freeze.path / (p + ".feat"))
        assert got.shape == want[p].shape and cosine(got, want[p]) >= 1 - 1e-6, p
    assert at_freeze.ctl("config")["features"]["model_loaded"] is True
    assert at_freeze.ctl("stats")["feat"]["computed"] == len(paths)
    assert len(list((tmp_path / "rcache-ref").glob("model-*.pt"))) == 1


def test_an_int8_storage_side_is_finished_in_a_namespace_of_its_own(tmp_path, storage, mounter):
    """Rows an int8 storage side sends differ from fp32's beyond rounding: the freeze point's
    features finished from them live in a namespace of their own (naming the calibration),
    within cosine 0.99 of those finished from fp32 rows."""
    _, f32, paths = storage(name="f", classes=1, per_class=3, split="layer2")
    _, q8, _ = storage(name="q", classes=1, per_class=3, split="layer2", precision="int8")
    rf = remote(mounter, tmp_path, [f32.path], cache="rf")
    rq = remote(mounter, tmp_path, [q8.path], cache="rq")
    for p in paths:
        got, want = np.load(rq.path / (p + ".feat")), np.load(rf.path / (p + ".feat"))
        assert got.shape == want.shape and cosine(got, want) >= 0.99, (p, cosine(got, want))
    assert rq.ctl("config")["features"]["namespace"] != rf.ctl("config")["features"]["namespace"]


def test_a_cache_disk_without_room_for_the_model_still_serves_the_freeze_point(
        tmp_path, storage, mounter):
    """The default (features=freeze) on a cache directory too small for the model: the model
    is loaded from memory instead (a warning in the log), and the freeze point's features are
    served; a mount on a cache directory with room gives the same bytes."""
    _, st, paths = storage(classes=1, per_class=3, split="layer2")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "hapifs-test", str(disk)], check=True)
    small = roomy = None
    try:
        small = remote(mounter, tmp_path, [st.path], cache=str(disk / "cache"), cache_size="2M")
        got = feats(small.path, paths)
        assert small.ctl("stats")["feat"]["computed"] == len(paths)
        assert not list((disk / "cache").glob("model-*")), "a model where there is no room"
        assert "cannot keep the model" in small.log_text()
        roomy = remote(mounter, tmp_path, [st.path], cache="rcache-roomy")
        assert feats(roomy.path, paths) == got
        assert np.load(roomy.path / (paths[0] + ".feat")).shape == \
            tuple(roomy.ctl("config")["split"]["shape"])
    finally:
        for m in (small, roomy):
            if m is not None:
                m.unmount()
        subprocess.run(["umount", str(disk)], check=False)


def assert_wrong_model_refused(r, paths, cache):
    """A model that is not the config's: .feat reads fail with EIO, errors and the config say
    why, nothing is kept of it, and the rest of the tree is served."""
    for p in paths:
        with pytest.raises(OSError) as e:
            (r.path / (p + ".feat")).read_bytes()
        assert e.value.errno == errno.EIO, e.value
    errors = (r.path / ".hapifs" / "errors").read_text()
    assert "features=freeze: the storage side's model has digest" in errors, errors
    assert r.ctl("config")["features"]["error"].startswith("features=freeze: ")
    assert not list((cache).glob("model-*")), "a wrong model was kept"
    assert (r.path / "class0").is_dir()


def test_features_freeze_with_a_model_that_is_not_the_configs_is_eio(tmp_path, storage,
                                                                      mounter):
    """A storage side's model whose digest is not its config's (or none at all): the mount
    comes up, its .feat reads fail with EIO, one clear line in errors says why, and nothing
    is kept of that model."""
    src, st, paths = storage(classes=1, per_class=2, split="layer2")
    fake = fake_storage(tmp_path, st, "class0")
    (fake / ".hapifs" / "model").write_bytes(b"not the model the config names")
    r = remote(mounter, tmp_path, [fake], features="freeze")
    assert_wrong_model_refused(r, paths, tmp_path / "rcache")


def test_a_model_that_cannot_be_used_is_met_when_a_split_before_the_freeze_point_needs_it(
        tmp_path, storage, mounter):
    """A source whose config is at the freeze point: the model waits. The first index before
    the freeze point loads it, and a model that is not the config's then refuses that index
    (EIO, one line in errors, the reason in the config); the rest of the tree is served."""
    _, ref, _ = storage(name="ref", classes=1, per_class=2, split="pool")
    _, st, paths = storage(classes=1, per_class=2, split="layer2")
    fake = fake_storage(tmp_path, st, "class0")
    config = json.loads((fake / ".hapifs" / "config").read_text())
    config["split"] = ref.ctl("config")["split"]  # it says: at the freeze point
    (fake / ".hapifs" / "config").write_text(json.dumps(config))
    (fake / ".hapifs" / "model").write_bytes(b"not the model the config names")
    r = remote(mounter, tmp_path, [fake])
    assert r.ctl("config")["features"]["model_loaded"] is False
    assert r.ctl("config")["features"].get("error") is None
    assert_wrong_model_refused(r, paths, tmp_path / "rcache")


def test_features_freeze_hold_their_shape_while_the_split_changes(tmp_path, storage, mounter):
    """features=freeze under 6 concurrent readers while the storage side's split goes from the
    stem to the freeze point and back, the compute cache evicted between: every read succeeds,
    with the freeze point's shape, within fp16's rounding of the reference."""
    src, st, paths = storage(classes=3, per_class=4, split="pool")
    r = remote(mounter, tmp_path, [st.path], features="freeze", refresh=0)
    want = {p: np.load(r.path / (p + ".feat")).astype(np.float32) for p in paths}
    shape = want[paths[0]].shape
    stop, bad, reads = threading.Event(), [], [0]

    def reader(seed):
        order = list(paths)
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            rng.shuffle(order)
            for p in order:
                try:
                    drop_pages(r.path, [p])  # read by the daemon, not the kernel's copy
                    got = np.load(r.path / (p + ".feat"))
                except (OSError, ValueError) as e:
                    bad.append((p, repr(e)))
                    continue
                reads[0] += 1
                if got.shape != shape or cosine(got, want[p]) < 0.9999:
                    bad.append((p, got.shape, cosine(got, want[p])))
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        for split in ("stem", "layer3", "layer1", "pool", "layer2"):
            ctl_write(st, f"split {split}")
            ctl_write(r, "evict")
            time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not bad, bad[:5]
    assert reads[0] > len(paths) * 6, reads
    feat = r.ctl("stats")["feat"]
    assert feat["computed"] > 0, feat
    if os.environ.get("HAPI_TEST_VERBOSE"):
        print(f"features=freeze under split changes: {reads[0]} reads, {feat}")


def test_warm_and_evict_through_hapifs_ctl(tmp_path, storage, mounter):
    src, st, paths = storage(classes=3, per_class=4)
    r = remote(mounter, tmp_path, [st.path], features="split")
    ctl = Path(os.environ.get("HAPI_BUILD_ROOT", Path(__file__).resolve().parent.parent / "build")) / "tools" / "hapifs-ctl"
    out = subprocess.run([str(ctl), "warm", str(r.path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    stats = r.ctl("stats")
    assert stats["warm"]["state"] == "done" and stats["warm"]["total"] == len(paths)
    assert stats["feat"]["fetched"] == len(paths) and stats["remote"]["packs"] == 3
    assert feats(r.path, paths) == feats(st.path, paths)
    assert r.ctl("stats")["feat"]["misses"] == 0
    # the metrics of a remote mount: per source, labelled with its path
    from test_ctl import parse_metrics
    fams = parse_metrics((r.path / ".hapifs" / "metrics").read_text())
    (labels, value), = fams["hapifs_remote_source_packs_total"][2]
    assert labels == {"mountpoint": str(r.path), "source": str(st.path)} and value == 3
    assert fams["hapifs_remote_source_state"][2] == [
        ({"mountpoint": str(r.path), "source": str(st.path), "state": "ok"}, 1.0)]
    assert fams["hapifs_feat_fetched_total"][2][0][1] == len(paths)
    # status prints on a remote mount too
    out = subprocess.run([str(ctl), "status", str(r.path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([str(ctl), "evict", "class1", str(r.path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert r.ctl("stats")["cache"]["namespace"]["entries"] == len(paths) - 4
    # storage-side commands are refused with the reason
    out = subprocess.run([str(ctl), "set-split", "2", str(r.path)], capture_output=True, text=True)
    assert out.returncode != 0 and "storage side" in out.stderr


def test_remote_refuses_storage_options(tmp_path, storage, mounter, models):
    src, st, paths = storage(classes=1, per_class=1)
    with pytest.raises(RuntimeError, match="model= is an option of the storage side"):
        remote(mounter, tmp_path, [st.path], model=models())
    for option, value in (("precision", "bf16"), ("torch_threads", 1)):
        with pytest.raises(RuntimeError, match=f"{option}= on a remote mount goes with "
                           "features=freeze: features=split runs no stage here"):
            remote(mounter, tmp_path, [st.path], features="split", **{option: value})
    # precision=auto measures a storage mount's own model: not the compute side's option
    with pytest.raises(RuntimeError, match="precision=auto: expected fp32 or bf16"):
        remote(mounter, tmp_path, [st.path], precision="auto")
    with pytest.raises(RuntimeError, match="features=fast: expected split or freeze"):
        remote(mounter, tmp_path, [st.path], features="fast")


def test_mount_helper_and_fstab_for_a_remote_mount(tmp_path, storage):
    """mount -t hapifs A:B MNT -o remote and an fstab line: the helper takes the joined sources."""
    need_hapifs()
    if not Path("/sbin/mount.hapifs").exists():
        pytest.skip("hapifs is not installed (/sbin/mount.hapifs); tools/run-tests installs it")
    _, a, pa = storage("a", classes=1, per_class=3, seed=1)
    src_b, b, _ = storage("b", classes=2, per_class=3, seed=2)
    shutil.rmtree(src_b / "class0")
    mnt = tmp_path / "helper"
    mnt.mkdir()
    opts = f"remote,features=split,cache={tmp_path / 'hcache'},_netdev,nofail"
    r = subprocess.run(["mount", "-t", "hapifs", f"{a.path}:{b.path}", str(mnt), "-o", opts],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        assert sorted(os.listdir(mnt)) == ["class0", "class1"]
        assert feats(mnt, pa) == feats(a.path, pa)
    finally:
        pid = daemon_pid(mnt)
        subprocess.run(["umount", str(mnt)], check=True)
        assert wait_gone(pid)
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{a.path}:{b.path} {mnt} hapifs {opts},noauto 0 0\n")
    r = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        cfg = json.loads((mnt / ".hapifs" / "config").read_text())
        assert cfg["source"] == f"{a.path}:{b.path}"
        assert [s["path"] for s in cfg["remote"]["sources"]] == [str(a.path), str(b.path)]
    finally:
        pid = daemon_pid(mnt)
        subprocess.run(["umount", str(mnt)], check=True)
        assert wait_gone(pid)


def test_warm_stop(tmp_path, storage, mounter, monkeypatch):
    """warm stop on a remote mount ends the walk: stats say stopped, and the folders it had not
    reached are not fetched."""
    # while this file exists the storage daemon loads no image: the remote warm-up's first
    # fetch waits on it, so the warm-up is surely in progress when it is stopped
    hold = tmp_path / "hold"
    monkeypatch.setenv("HAPIFS_TEST_HOLD", str(hold))
    src, st, paths = storage(classes=60, per_class=2, batch=1)
    r = remote(mounter, tmp_path, [st.path], fetch_threads=1)
    ctl_write(r, "warm stop")  # nothing running: not an error
    assert r.ctl("stats")["warm"]["state"] == "idle"
    hold.touch()
    ctl_write(r, "warm")
    wait_until(lambda: r.ctl("stats")["remote"]["fetches_running"] == 1)
    ctl_write(r, "warm stop")
    stats = r.ctl("stats")
    assert stats["warm"]["state"] == "stopped", stats["warm"]
    assert stats["remote"]["packs"] == 0, stats["remote"]
    hold.unlink()
    # the fetch in progress and the one queued (fetch_threads=1) finish; no other starts
    wait_until(lambda: r.ctl("stats")["remote"]["fetches_running"] ==
               r.ctl("stats")["remote"]["fetches_queued"] == 0)
    packs = r.ctl("stats")["remote"]["packs"]
    time.sleep(1)
    later = r.ctl("stats")
    assert later["remote"]["packs"] == packs <= 2, later["remote"]
    assert later["warm"]["state"] == "stopped"
    ctl_write(r, "warm class7")  # a new warm-up runs to the end
    end = time.time() + 60
    while r.ctl("stats")["warm"]["state"] != "done" and time.time() < end:
        time.sleep(0.05)
    warm = r.ctl("stats")["warm"]
    assert warm["state"] == "done" and warm["path"] == "class7" and warm["total"] == 2


def test_a_pack_taken_after_its_index_changed_is_not_misread(tmp_path, storage, mounter):
    """The compute side reads a pack by the index it kept: a pack of another version is refused
    and its rows are read again by the directory's new index, never mapped to the old names."""
    src, st, paths = storage(classes=1, per_class=4)
    r = remote(mounter, tmp_path, [st.path], refresh=600, features="split")
    os.stat(r.path / (paths[1] + ".feat"))  # the index is read and kept; nothing is fetched
    assert r.ctl("stats")["remote"]["sources"][0]["packs"] == 0
    # one image goes, another comes after the rest: the same row count, every row moved by one
    os.unlink(src / paths[0])
    shutil.copy(src / paths[3], src / "class0" / "zzz.jpg")
    wait_until(lambda: "zzz.jpg" in (st.path / "class0" / INDEX).read_text())
    want = (st.path / (paths[1] + ".feat")).read_bytes()
    assert (r.path / (paths[1] + ".feat")).read_bytes() == want
    # one more image: a pack of another size is read by the new index too, not refused for good
    shutil.copy(src / paths[2], src / "class0" / "zzz2.jpg")
    wait_until(lambda: "zzz2.jpg" in (st.path / "class0" / INDEX).read_text())
    ctl_write(r, "evict all")
    assert (r.path / (paths[2] + ".feat")).read_bytes() == (st.path / (paths[2] + ".feat")).read_bytes()
    s = r.ctl("stats")["remote"]["sources"][0]
    assert s["fetch_failures"] >= 1  # the packs of the older index were refused, then read again


@pytest.fixture
def sshfs_view(tmp_path):
    """sshfs_view(dir) -> dir seen through sshfs with the options deployment.md recommends
    (attributes and names cached 600 s), its sftp-server run directly instead of over ssh."""
    if not shutil.which("sshfs") or not Path("/usr/lib/openssh/sftp-server").exists():
        pytest.fail("sshfs and openssh-sftp-server are installed by tools/install-deps")
    views = []

    def make(d):
        fake_ssh = tmp_path / "fake-ssh"
        fake_ssh.write_text("#!/bin/sh\nexec /usr/lib/openssh/sftp-server\n")
        fake_ssh.chmod(0o755)
        view = tmp_path / f"sshfs-{len(views)}"
        view.mkdir()
        subprocess.run(["sshfs", f"localhost:{d}", str(view), "-o",
                        f"ssh_command={fake_ssh},ro,kernel_cache,attr_timeout=600,"
                        "entry_timeout=600,dir_cache=yes,dcache_timeout=600"], check=True)
        views.append(view)
        return view
    yield make
    for v in views:
        subprocess.run(["fusermount3", "-u", "-z", str(v)])


def test_pack_files_read_through_a_remote_mount_whole(tmp_path, storage, mounter, sshfs_view):
    """A storage mount's pack files show a size that is not their snapshot's (an index's is a
    bound, its pack's the directory's now), and sshfs shows the size it saw first for 600 s:
    read through a remote mount, they read to their end, without an error."""
    src, st, paths = storage(classes=1, per_class=4)
    view = sshfs_view(st.path)
    r = remote(mounter, tmp_path, [view])
    d = "class0"
    bound = os.stat(view / d / INDEX).st_size  # while every image is pending: the longest
    pack_size = os.stat(view / d / PACK).st_size
    feats(st.path, paths)  # computed: each status is shorter than "pending"
    assert len((st.path / d / INDEX).read_bytes()) < bound
    index = json.loads((r.path / d / INDEX).read_bytes())
    assert [e["name"] for e in index["entries"]] == sorted(Path(p).name for p in paths)
    assert np.array_equal(np.load(r.path / d / PACK), np.load(st.path / d / PACK))
    # the directory grows: the next reads see the new pack whole, not the size sshfs kept
    shutil.copy(src / paths[0], src / d / "zzz.jpg")
    wait_until(lambda: "zzz.jpg" in (st.path / d / INDEX).read_text())
    # an index is made at each open, the pack's name is renewed when the storage daemon sees
    # the change (watch=1): until then an open finds the snapshot before it
    wait_until(lambda: np.load(st.path / d / PACK).shape[0] == 5)
    assert os.stat(view / d / PACK).st_size == pack_size
    assert len(json.loads((r.path / d / INDEX).read_bytes())["entries"]) == 5
    assert np.load(r.path / d / PACK).shape[0] == 5


def test_a_read_that_sees_the_split_change_does_not_hang(tmp_path, storage, mounter):
    """A read that misses the cache reads its directory's index again; when that finds the
    storage side's new split, the kernel is told to forget the remote .feat files' pages, this
    one's too, whose page the kernel holds locked until the read is answered: told from within
    the read, the daemon waited for itself, for ever."""
    src, st, paths = storage(classes=1, per_class=4)
    r = remote(mounter, tmp_path, [st.path], refresh=0, features="split")
    f = r.path / (paths[0] + ".feat")
    old = f.read_bytes()
    fd = os.open(f, os.O_RDONLY)
    try:
        ctl_write(st, "split 2")
        wait_until(lambda: st.ctl("config")["split"]["index"] == 2)
        ctl_write(r, "evict all")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel asks the daemon again
        got = {}

        def read():
            try:
                got["data"] = os.pread(fd, 1 << 20, 0)
            except OSError as e:
                got["data"] = e.errno
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(60)
        if t.is_alive():
            abort_connection(r.path)
            pytest.fail("a read that found the new split never returned (the daemon waited for "
                        "the kernel, which waited for the read)")
    finally:
        os.close(fd)
    # the open file's split is no longer served nor cached: EIO, never another split's bytes
    # under its header
    assert got["data"] == errno.EIO
    assert "changed namespace (its split) since this file was opened" in \
        (r.path / ".hapifs" / "errors").read_text()
    assert f.read_bytes() == (st.path / (paths[0] + ".feat")).read_bytes() != old


def test_an_open_feat_keeps_its_size_after_a_split_change(tmp_path, storage, mounter):
    """A .feat node is what its bytes are (split, image version): after the storage side's
    split changes, a file open before keeps its size and bytes, and the name shows the new
    split's file whole. One node by name alone gave the open file the new split's size over the
    old split's bytes (a header of one split, the length of another)."""
    src, st, paths = storage(classes=1, per_class=3)
    ctl_write(st, "split 2")
    wait_until(lambda: st.ctl("config")["split"]["index"] == 2)
    r = remote(mounter, tmp_path, [st.path], refresh=0, features="split")
    f = r.path / (paths[0] + ".feat")
    old = f.read_bytes()
    assert old == (st.path / (paths[0] + ".feat")).read_bytes()
    fd = os.open(f, os.O_RDONLY)
    try:
        ctl_write(st, "split 3")
        wait_until(lambda: st.ctl("config")["split"]["index"] == 3)
        new = (st.path / (paths[1] + ".feat")).read_bytes()
        assert len(new) != len(old)
        # another file's read finds the directory's new index (and the split change)
        ctl_write(r, f"evict {paths[1]}")
        wait_until(lambda: (r.path / (paths[1] + ".feat")).read_bytes() == new)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel asks the daemon again
        assert os.fstat(fd).st_size == len(old)
        assert os.pread(fd, 1 << 20, 0) == old  # from the compute cache: its namespace's row
    finally:
        os.close(fd)
    got = f.read_bytes()
    assert got == (st.path / (paths[0] + ".feat")).read_bytes() and len(got) == len(new)
    assert os.stat(f).st_size == len(new)


def test_an_index_read_that_hangs_does_not_serve_old_features(tmp_path, storage, mounter,
                                                             monkeypatch):
    """While one reader reads a directory's index again, the others use the old one for at most
    2 s past refresh=, then wait for it: an index read that hung on a dead link had the others
    served the features of an image replaced meanwhile, for as long as it hung."""
    from PIL import Image
    hold = tmp_path / "hold"  # while it exists the storage side makes no index
    monkeypatch.setenv("HAPIFS_TEST_HOLD_INDEX", str(hold))
    src, st, paths = storage(classes=1, per_class=3)
    r = remote(mounter, tmp_path, [st.path], refresh=1, features="split")
    p = paths[0]
    old = (r.path / (p + ".feat")).read_bytes()  # cached on the compute side
    fd = os.open(r.path / (paths[1] + ".feat"), os.O_RDONLY)
    ctl_write(r, f"evict {paths[1]}")  # its next read misses: it reads the index again
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    got = {}

    def read(key):
        try:
            got[key] = os.pread(fd, 1 << 20, 0) if key == "miss" else \
                (r.path / (p + ".feat")).read_bytes()
        except OSError as e:
            got[key] = e.errno
    hold.touch()
    try:
        Image.fromarray(np.full((40, 56, 3), 90, np.uint8)).save(src / p, quality=90)
        time.sleep(1.2)
        miss = threading.Thread(target=read, args=("miss",), daemon=True)
        miss.start()  # past refresh=: reads the index again, and waits on the hold
        wait_until(lambda: r.ctl("stats")["feat"]["misses"] >= 1)
        time.sleep(3)
        later = threading.Thread(target=read, args=("later",), daemon=True)
        later.start()  # past refresh= + 2 s: must not be served by the old index
        later.join(1)
    finally:
        hold.unlink()
    miss.join(60)
    later.join(60)
    os.close(fd)
    new = (st.path / (p + ".feat")).read_bytes()
    assert new != old
    assert got.get("later") != old, "served the replaced image's features"
    assert got.get("later") == new, got.get("later")


def fill(disk):
    """Writes a file on disk until it has no room left; returns its path."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler


def test_a_full_cache_disk_costs_the_cache_never_a_read(tmp_path, storage, mounter):
    """The compute cache's filesystem full: every feature is served all the same, uncached and
    counted (cache_put_failures); once there is room again, fetched features are kept."""
    src, st, paths = storage(classes=3, per_class=8)
    want = feats(st.path, paths)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "hapifs-test", str(disk)], check=True)
    r = None
    try:
        r = remote(mounter, tmp_path, [st.path], cache=str(disk / "cache"), cache_size="2M",
                   features="split")
        filler = fill(disk)
        assert feats(r.path, paths) == want  # no read failed for want of room
        s1 = r.ctl("stats")["feat"]
        assert s1["failed"] == 0 and s1["cache_put_failures"] > 0, s1
        # a pack per directory, not per file: the rows the cache refused are kept in memory
        assert s1["fetched"] == len(paths) and r.ctl("stats")["remote"]["packs"] == 3, s1
        assert s1["uncached_hits"] == len(paths) - 3, s1
        filler.unlink()  # room again: a row read from memory is offered the cache (once a
        time.sleep(1.1)  # second), which takes it; then rows are fetched and kept again
        drop_pages(r.path, paths)
        assert feats(r.path, paths) == want
        s2 = r.ctl("stats")["feat"]
        assert s2["fetched"] == 2 * len(paths), s2
        assert s2["cache_put_failures"] == s1["cache_put_failures"], (s1, s2)
        drop_pages(r.path, paths)
        assert feats(r.path, paths) == want
        s3 = r.ctl("stats")["feat"]
        assert s3["hits"] - s2["hits"] == len(paths), (s2, s3)  # served from the cache
        assert s3["fetched"] == s2["fetched"], (s2, s3)
    finally:
        if r is not None:
            r.unmount()
        subprocess.run(["umount", str(disk)], check=False)
