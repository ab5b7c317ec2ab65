"""Per-directory packs on a real mount: DIR/.hapifs-pack.npy and its index DIR/.hapifs-pack.json."""
import errno
import json
import os

import numpy as np
import pytest

from test_throughput import make_tree

PACK = ".hapifs-pack.npy"
INDEX = ".hapifs-pack.json"


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    paths = make_tree(src, classes=2, per_class=9, size=(48, 64))
    (src / "class0" / "notes.txt").write_text("not an image\n")
    # images in a subdirectory belong to its pack, not to class0's
    sub = make_tree(src / "class0" / "more", classes=1, per_class=2, size=(48, 64), seed=5)
    return src, paths, ["class0/more/" + p for p in sub]


def test_pack_is_the_directory_features_in_name_order(tree, mounter, models):
    src, paths, sub = tree
    m = mounter(src, model=models(), prefetch="off")
    d = m.path / "class0"
    # the size is exact before anything is computed, and nothing is listed
    size = os.stat(d / PACK).st_size
    assert m.ctl("stats")["feat"]["computed"] == 0
    assert PACK not in os.listdir(d) and INDEX not in os.listdir(d)

    names = sorted(p.split("/")[-1] for p in paths if p.startswith("class0/"))
    index = json.loads((d / INDEX).read_text())
    assert index["format"] == "hapifs-pack/1"
    assert index["namespace"] == m.ctl("config")["split"]["namespace"]
    assert [e["name"] for e in index["entries"]] == names
    assert index["count"] == len(names) and index["size"] == size
    for e in index["entries"]:
        st = os.stat(src / "class0" / e["name"])
        assert (e["size"], e["ino"], e["mtime_ns"]) == (st.st_size, st.st_ino, st.st_mtime_ns)
        assert e["status"] == "pending"

    pack = np.load(d / PACK, mmap_mode="r")
    feats = np.stack([np.load(d / (n + ".feat")) for n in names])
    assert pack.shape == feats.shape and pack.dtype == feats.dtype
    assert index["dtype"] == pack.dtype.str and index["row_shape"] == list(pack.shape[1:])
    assert size == index["header_bytes"] + pack.nbytes
    assert np.array_equal(np.asarray(pack), feats)
    # read whole too, as a copy would
    assert np.array_equal(np.load(d / PACK), feats)
    index = json.loads((d / INDEX).read_text())
    assert {e["status"] for e in index["entries"]} == {"cached"}
    stats = m.ctl("stats")
    assert stats["feat"]["computed"] == len(names)  # the rows and the .feat files shared them
    # one snapshot: with no_open a pack node keeps the one its first read took
    assert stats["pack"]["opens"] >= 1 and stats["pack"]["rows_failed"] == 0

    # the subdirectory has its own pack
    sub_pack = np.load(d / "more" / "class0" / PACK)
    assert sub_pack.shape[0] == len(sub)
    assert np.array_equal(sub_pack[1], np.load(m.path / (sub[1] + ".feat")))


def test_no_pack_where_there_are_no_images(tree, mounter, models, tmp_path):
    src, _, _ = tree
    (src / "empty").mkdir()
    m = mounter(src, model=models(), prefetch="off")
    for d in (m.path, m.path / "empty", m.path / "missing"):
        for name in (PACK, INDEX):
            with pytest.raises(FileNotFoundError):
                os.stat(d / name)
    with pytest.raises(OSError) as e:
        os.stat(m.path / "class0" / "notes.txt" / PACK)
    assert e.value.errno == errno.ENOTDIR
    with pytest.raises(OSError) as e:  # at open, or at the write (no_open)
        with open(m.path / "class0" / PACK, "wb") as f:
            f.write(b"x")
    assert e.value.errno == errno.EROFS


def test_an_undecodable_image_is_a_nan_row(tree, mounter, models):
    src, paths, _ = tree
    (src / "class1" / "004.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    m = mounter(src, model=models(), prefetch="off")
    d = m.path / "class1"
    pack = np.load(d / PACK)
    names = [e["name"] for e in json.loads((d / INDEX).read_text())["entries"]]
    bad = names.index("004.jpg")
    assert np.isnan(pack[bad]).all()
    for i, n in enumerate(names):
        if i != bad:
            assert np.array_equal(pack[i], np.load(d / (n + ".feat")))
            assert not np.isnan(pack[i]).any()
    entry = json.loads((d / INDEX).read_text())["entries"][bad]
    assert entry["status"] == "failed" and entry["error"]
    with pytest.raises(OSError) as e:
        (d / "004.jpg.feat").read_bytes()
    assert e.value.errno == errno.EIO
    assert m.ctl("stats")["pack"]["rows_failed"] >= 1


def test_a_read_waits_only_for_the_rows_it_covers(tmp_path, mounter, models):
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=96, size=(40, 40))
    m = mounter(src, model=models(), prefetch="off", batch=8)
    f = m.path / "class0" / PACK
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel read-ahead
        head = os.pread(fd, 4096, 0)
        assert head.startswith(b"\x93NUMPY")
        computed = m.ctl("stats")["feat"]["computed"]
        # a page covers a few rows; two batches are asked for ahead of them, not the directory
        assert 1 <= computed <= 4096 // 1024 + 1 + 2 * 8 + 8, computed
        # the last row, alone
        size = os.fstat(fd).st_size
        tail = os.pread(fd, 1024, size - 1024)
        assert len(tail) == 1024
    finally:
        os.close(fd)
    assert m.ctl("stats")["feat"]["computed"] < 96


def test_a_pack_follows_the_split(tree, mounter, models):
    src, _, _ = tree
    m = mounter(src, model=models(), prefetch="off", split="pool")
    d = m.path / "class0"
    before = np.load(d / PACK, mmap_mode="r").shape
    with open(m.path / ".hapifs" / "ctl", "w") as f:
        f.write("split layer3\n")
    after = np.load(d / PACK, mmap_mode="r")
    assert after.shape[0] == before[0] and after.shape[1:] != before[1:]
    assert after.shape[1:] == np.load(d / "000.jpg.feat").shape
    assert json.loads((d / INDEX).read_text())["namespace"] == \
        m.ctl("config")["split"]["namespace"]


def test_the_linear_probe_example_reads_packs(tree, mounter, models):
    import subprocess
    from conftest import PYTHON, SOURCE_ROOT
    src, paths, _ = tree
    (src / "class1" / "004.jpg").write_bytes(b"not an image at all")
    m = mounter(src, model=models(), prefetch="off", split="pool")
    r = subprocess.run([PYTHON, str(SOURCE_ROOT / "examples" / "probe-packs.py"), str(m.path),
                        "--val-fraction", "0.25"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # class0 and class1 have packs (the subdirectory class0/more is not a class of ROOT)
    assert lines[0].startswith("read 17 samples of 512 features from 2 packs"), lines[0]
    assert "(1 failed rows left out)" in lines[0]
    train_acc = float(lines[1].split()[2].rstrip(","))
    assert train_acc == 1.0  # 13 samples, 512 dimensions: a linear probe separates them
