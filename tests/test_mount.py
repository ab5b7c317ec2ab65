"""Mount-level tests: hapifs mounted for real over generated images, read like a training script would."""
import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (HAPIFS, Mount, daemon_pid, is_mounted, make_image_kinds,
                      need_hapifs, reference_features, wait_gone)

RESNET_STAGES = ["stem", "layer1", "layer2", "layer3", "layer4", "pool", "fc"]


@pytest.fixture(scope="module")
def kinds_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    made = make_image_kinds(root)
    (root / "labels.csv").write_text("name,label\na,1\n")
    return root, made


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def max_rel(a, b):
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def walk(root):
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for f in filenames:
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def test_listing_hides_images_and_control_dir(kinds_tree, models, mounter):
    src, made = kinds_tree
    m = mounter(src, model=models())
    listed = walk(m.path)
    assert listed == sorted([p + ".feat" for p in made] + ["labels.csv"])
    assert ".hapifs" not in os.listdir(m.path)
    assert sorted(os.listdir(m.path / ".hapifs")) == ["config", "ctl", "errors", "metrics", "model",
                                                      "policy", "profile", "stats"]
    assert (m.path / "labels.csv").read_text() == "name,label\na,1\n"
    # a raw image is hidden, not just unlisted
    with pytest.raises(FileNotFoundError):
        os.stat(m.path / "jpeg" / "baseline444.jpg")
    # DatasetFolder sees the class folders and nothing else
    import torchvision
    ds = torchvision.datasets.DatasetFolder(str(m.path), loader=np.load, extensions=(".feat",))
    assert ds.classes == ["jpeg", "png"]
    assert len(ds) == len(made)


def test_show_raw(kinds_tree, models, mounter):
    src, made = kinds_tree
    m = mounter(src, model=models(), show_raw=1)
    listed = set(walk(m.path))
    for p in made:
        assert p in listed and p + ".feat" in listed
        assert (m.path / p).read_bytes() == (src / p).read_bytes()


def test_stat_size_is_exact_and_a_valid_npy(kinds_tree, models, mounter):
    src, made = kinds_tree
    m = mounter(src, model=models(), split="layer3", dtype="fp32")
    cfg = m.ctl("config")
    assert cfg["split"]["stage"] == "layer3"
    for p in made:
        f = m.path / (p + ".feat")
        size = f.stat().st_size
        data = f.read_bytes()
        assert len(data) == size, p
        assert data[:6] == b"\x93NUMPY"
        header_len = 10 + int.from_bytes(data[8:10], "little")
        assert header_len % 64 == 0
        arr = np.load(f)
        assert arr.dtype == np.float32 and arr.shape == (256, 4, 4)
        assert size == header_len + arr.nbytes
        assert f.stat().st_mtime == (src / p).stat().st_mtime


@pytest.mark.parametrize("split", ["pool", "layer2"])
def test_parity_fp32(kinds_tree, models, mounter, split):
    src, made = kinds_tree
    archive = models()
    m = mounter(src, model=archive, split=split, dtype="fp32")
    k = RESNET_STAGES.index(split) + 1
    worst_cos, worst_rel = 1.0, 0.0
    for p in made:
        got = np.load(m.path / (p + ".feat"))
        ref = reference_features(archive, src / p, k)
        assert got.shape == ref.shape, p
        c, r = cosine(got, ref), max_rel(got, ref)
        worst_cos, worst_rel = min(worst_cos, c), max(worst_rel, r)
        assert c >= 0.9999 and r <= 1e-3, f"{p}: cosine {c}, max relative error {r}"
    print(f"split {split}: worst cosine {worst_cos:.7f}, worst max rel err {worst_rel:.2e}")


def test_parity_fp16(kinds_tree, models, mounter):
    src, made = kinds_tree
    archive = models()
    m = mounter(src, model=archive)  # fp16 at the pooling split by default
    assert m.ctl("config")["split"]["stage"] == "pool"
    for p in made:
        got = np.load(m.path / (p + ".feat"))
        assert got.dtype == np.float16 and got.shape == (512,)
        ref = reference_features(archive, src / p, 6)
        # half precision: 11 significant bits, plus the fp32 drift of the frozen graph
        np.testing.assert_allclose(got.astype(np.float32), ref, rtol=2e-3,
                                   atol=2e-3 * np.abs(ref).max(), err_msg=p)


def test_second_read_is_a_cache_hit_across_remounts(kinds_tree, models, mounter, tmp_path):
    src, made = kinds_tree
    cache = tmp_path / "shared-cache"
    m = mounter(src, model=models(), cache=str(cache))
    first = {p: (m.path / (p + ".feat")).read_bytes() for p in made}
    st = m.ctl("stats")
    assert st["feat"]["computed"] == len(made)
    assert st["cache"]["entries"] >= len(made)
    m.unmount()
    m2 = mounter(src, model=models(), cache=str(cache))
    second = {p: (m2.path / (p + ".feat")).read_bytes() for p in made}
    assert second == first
    st2 = m2.ctl("stats")
    assert st2["feat"]["computed"] == 0
    assert st2["feat"]["hits"] >= len(made)


def test_changed_source_is_recomputed(tmp_path, models, mounter):
    from PIL import Image
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    img = src / "a" / "x.jpg"
    Image.new("RGB", (80, 80), (200, 10, 10)).save(img)
    m = mounter(src, model=models(), dtype="fp32")
    red = np.load(m.path / "a" / "x.jpg.feat")
    Image.new("RGB", (80, 80), (10, 10, 200)).save(img)
    os.utime(img, ns=(time.time_ns(), time.time_ns() + 10**9))
    time.sleep(1.2)  # attribute timeout
    blue = np.load(m.path / "a" / "x.jpg.feat")
    assert not np.allclose(red, blue)
    np.testing.assert_allclose(blue, reference_features(models(), img, 6), rtol=1e-3,
                               atol=1e-3 * np.abs(blue).max())


def test_bad_images_fail_alone(tmp_path, models, mounter):
    from PIL import Image
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    Image.new("RGB", (90, 70), (1, 2, 3)).save(src / "c" / "good.jpg")
    full = (src / "c" / "good.jpg").read_bytes()
    (src / "c" / "truncated.jpg").write_bytes(full[: len(full) // 2])
    (src / "c" / "garbage.jpg").write_bytes(b"this is not an image" * 10)
    (src / "c" / "empty.png").write_bytes(b"")
    Image.new("RGB", (300, 200)).save(src / "c" / "huge.png")
    m = mounter(src, model=models(), max_pixels=50000)
    for bad in ["truncated.jpg", "garbage.jpg", "empty.png", "huge.png"]:
        with pytest.raises(OSError) as e:
            (m.path / "c" / (bad + ".feat")).read_bytes()
        assert e.value.errno == errno.EIO, bad
    assert np.load(m.path / "c" / "good.jpg.feat").shape == (512,)
    errs = m.ctl("errors")
    assert errs["count"] == 4
    by_path = {e["path"]: e for e in errs["errors"]}
    assert set(by_path) == {"c/truncated.jpg", "c/garbage.jpg", "c/empty.png", "c/huge.png"}
    assert "pixel" in by_path["c/huge.png"]["error"]
    log = m.log_text()
    for bad in by_path:
        assert bad in log
    assert m.ctl("stats")["feat"]["failed"] >= 4  # a kernel retry of a failed read counts again
    assert daemon_pid(m.path) == m.pid  # still serving


def test_symlinks_stay_beneath_the_root(tmp_path, models, mounter):
    from PIL import Image
    outside = tmp_path / "outside"
    outside.mkdir()
    Image.new("RGB", (64, 64), (9, 9, 9)).save(outside / "secret.jpg")
    (outside / "secret.txt").write_text("secret")
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    Image.new("RGB", (64, 64), (50, 60, 70)).save(src / "d" / "real.jpg")
    (src / "d" / "inside.jpg").symlink_to("real.jpg")
    (src / "d" / "out.jpg").symlink_to(outside / "secret.jpg")
    (src / "d" / "out.txt").symlink_to("../../outside/secret.txt")
    (src / "escape").symlink_to(outside)
    m = mounter(src, model=models())
    assert sorted(os.listdir(m.path / "d")) == ["inside.jpg.feat", "real.jpg.feat"]
    assert sorted(os.listdir(m.path)) == ["d"]
    for name in ["d/out.jpg.feat", "d/out.txt", "escape", "escape/secret.txt"]:
        with pytest.raises(FileNotFoundError):
            os.stat(m.path / name)
    a = np.load(m.path / "d" / "inside.jpg.feat")
    b = np.load(m.path / "d" / "real.jpg.feat")
    assert np.array_equal(a, b)


def write_to(path, mode):
    with open(path, mode) as f:
        f.write(b"x" if "b" in mode else "x")


@pytest.mark.parametrize("no_open", [1, 0])
def test_writes_are_refused(kinds_tree, models, mounter, no_open):
    """EROFS: at open when the daemon is asked (no_open=0, or a truncation), else at the write
    (no_open=1: the kernel opens files without asking)."""
    src, made = kinds_tree
    m = mounter(src, model=models(), no_open=no_open)
    feat = m.path / (next(iter(made)) + ".feat")
    attempts = [
        lambda: write_to(feat, "wb"),
        lambda: write_to(m.path / "labels.csv", "a"),
        lambda: write_to(feat, "r+"),
        lambda: open(m.path / "new.txt", "w"),
        lambda: os.mkdir(m.path / "newdir"),
        lambda: os.unlink(m.path / "labels.csv"),
        lambda: os.rename(m.path / "labels.csv", m.path / "l2.csv"),
        lambda: os.utime(feat),
        lambda: os.chmod(feat, 0o777),
        lambda: write_to(m.path / ".hapifs" / "stats", "w"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS
    assert (m.path / "labels.csv").read_text() == "name,label\na,1\n"


def run_mount(args):
    return subprocess.run([str(HAPIFS)] + args, capture_output=True, text=True, timeout=120)


def test_mount_errors_are_one_clear_line(tmp_path, models):
    need_hapifs()
    src, mnt, cache = tmp_path / "src", tmp_path / "mnt", tmp_path / "cache"
    for d in (src, mnt, cache):
        d.mkdir()
    good = models()
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a model at all")
    import torch
    plain = tmp_path / "plain.pt"
    torch.jit.save(torch.jit.script(torch.nn.Sequential(torch.nn.ReLU())), str(plain))
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        ([f"model={good},cache={cache},dtype=int8"], "dtype=int8"),
        ([f"model={good},cache={cache},frobnicate=1"], "frobnicate=1"),
        ([f"model={tmp_path}/missing.pt,cache={cache}"], "missing.pt"),
        ([f"model={junk},cache={cache}"], "junk.pt"),
        ([f"model={plain},cache={cache}"], "hapifs.json"),
        ([f"model={good},cache={afile}"], "not a directory"),
        ([f"model={good},cache={cache},split=layer9"], "layer9"),
        ([f"model={good},cache={cache},split=fc,freeze=pool"], "split"),
        ([f"cache={cache}"], "model="),
    ]
    for opts, needle in cases:
        r = run_mount([str(src), str(mnt), "-o", opts[0]])
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0, opts
        assert len(lines) == 1, (opts, r.stderr)
        assert lines[0].startswith("hapifs: ") and needle in lines[0], (opts, r.stderr)
        assert not is_mounted(mnt)
        assert daemon_pid(mnt) is None
    r = run_mount([str(tmp_path / "nosuch"), str(mnt), "-o", f"model={good}"])
    assert r.returncode != 0 and "source" in r.stderr


def test_unusable_cache_dir(tmp_path, models):
    need_hapifs()
    src, mnt, ro = tmp_path / "src", tmp_path / "mnt", tmp_path / "ro"
    for d in (src, mnt, ro):
        d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        r = run_mount([str(src), str(mnt), "-o", f"model={models()},cache={ro}"])
        assert r.returncode != 0 and "read-only" in r.stderr, r.stderr
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    # a cache directory holding something that is not an LMDB store
    bad = tmp_path / "badcache"
    bad.mkdir()
    (bad / "data.mdb").write_bytes(os.urandom(20000))
    r = run_mount([str(src), str(mnt), "-o", f"model={models()},cache={bad}"])
    assert r.returncode != 0 and str(bad) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not is_mounted(mnt)


def test_two_mounts_of_one_model_at_different_splits(kinds_tree, models, mounter, tmp_path):
    src, made = kinds_tree
    archive = models()
    cache = tmp_path / "one-cache"
    a = mounter(src, model=archive, cache=str(cache), split="layer3", dtype="fp32")
    b = mounter(src, model=archive, cache=str(cache), split=6, dtype="fp32")
    assert a.ctl("config")["cache"]["namespace"] != b.ctl("config")["cache"]["namespace"]
    p = "jpeg/baseline420.jpg"
    fa, fb = np.load(a.path / (p + ".feat")), np.load(b.path / (p + ".feat"))
    assert fa.shape == (256, 4, 4) and fb.shape == (512,)
    assert cosine(fa, reference_features(archive, src / p, 4)) >= 0.9999
    assert cosine(fb, reference_features(archive, src / p, 6)) >= 0.9999


def test_unmount_leaves_nothing(kinds_tree, models, tmp_path):
    need_hapifs()
    src, made = kinds_tree
    for how in ["fusermount3", "umount", "sigterm"]:
        m = Mount(src, tmp_path / f"m-{how}", {"model": models(), "cache": tmp_path / "c"})
        assert is_mounted(m.path) and m.pid
        np.load(m.path / (next(iter(made)) + ".feat"))  # libtorch threads are running
        if how == "fusermount3":
            subprocess.run(["fusermount3", "-u", str(m.path)], check=True)
        elif how == "umount":
            subprocess.run(["umount", str(m.path)], check=True)
        else:
            os.kill(m.pid, signal.SIGTERM)
        assert wait_gone(m.pid), how
        time.sleep(0.1)
        assert not is_mounted(m.path), how


def test_stopped_with_files_open(kinds_tree, models, tmp_path):
    """A daemon stopped while files and directories are open frees what they hold.

    The kernel never sends their releases; under the sanitizer lane a handle not
    freed is a leak report, and the log says how many there were.
    """
    need_hapifs()
    src, made = kinds_tree
    # no_open=0: with opens, the kernel's handles are the daemon's to free
    m = Mount(src, tmp_path / "mnt", {"model": models(), "cache": tmp_path / "c",
                                      "show_raw": 1, "no_open": 0})
    opened = []
    try:
        p = next(iter(made))
        opened.append(open(m.path / (p + ".feat"), "rb"))
        opened[-1].read(64)
        opened.append(open(m.path / "jpeg" / ".hapifs-pack.npy", "rb"))
        opened[-1].read(64)
        opened.append(open(m.path / ".hapifs" / "stats", "rb"))
        opened.append(open(m.path / p, "rb"))
        opened.append(os.scandir(m.path / "png"))
        next(opened[-1])
        os.kill(m.pid, signal.SIGTERM)
        assert wait_gone(m.pid)
    finally:
        for f in opened:
            try:
                f.close()
            except OSError:
                pass  # ENOTCONN: the daemon has gone
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=False)
        if not wait_gone(m.pid, 1):
            os.kill(m.pid, signal.SIGKILL)
    assert "stopped with 4 files and 1 directories still open" in m.log_text()


def test_mount_helper_and_fstab(kinds_tree, models, tmp_path):
    need_hapifs()
    helper = Path("/sbin/mount.hapifs")
    if not helper.exists():
        pytest.skip("hapifs is not installed (/sbin/mount.hapifs); tools/run-tests installs it")
    src, made = kinds_tree
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cache = tmp_path / "cache"
    opts = f"model={models()},cache={cache},_netdev,nofail"
    r = subprocess.run(["mount", "-t", "hapifs", str(src), str(mnt), "-o", opts],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        assert is_mounted(mnt)
        assert np.load(mnt / (next(iter(made)) + ".feat")).shape == (512,)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert not is_mounted(mnt)
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{src} {mnt} hapifs {opts},noauto,x-systemd.automount 0 0\n")
    r = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        cfg = json.loads((mnt / ".hapifs" / "config").read_text())
        assert cfg["source"] == str(src)
    finally:
        pid = daemon_pid(mnt)
        subprocess.run(["umount", str(mnt)], check=True)
        assert wait_gone(pid)
    # mount -t with a bad option fails with the message on stderr
    r = subprocess.run(["mount", "-t", "hapifs", str(src), str(mnt), "-o", opts + ",dtype=bad"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "dtype=bad" in r.stderr


def test_threads_are_named_for_their_work(kinds_tree, models, mounter):
    """top -H tells the inference from decoding and the rest; pidof still finds the daemon."""
    src, made = kinds_tree
    m = mounter(src, model=models())
    for p in made:
        (m.path / (p + ".feat")).read_bytes()
    names = [(t / "comm").read_text().strip() for t in Path(f"/proc/{m.pid}/task").iterdir()]
    assert names.count("hapifs-infer") >= 1
    assert names.count("hapifs-decode") == int(m.ctl("config")["runtime"]["decode_threads"]), names
    assert "hapifs-keeper" in names and "hapifs-watch" in names, names
    assert Path(f"/proc/{m.pid}/comm").read_text().strip() == "hapifs"
    pids = subprocess.run(["pidof", "hapifs"], capture_output=True, text=True).stdout.split()
    assert str(m.pid) in pids
