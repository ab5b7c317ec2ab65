"""The throughput engine through a real mount: single flight, batching, fast mode, memory budget, warm-up, ctl."""
import errno
import os
import re
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import _smooth, reference_features


def make_tree(root, classes=4, per_class=12, size=(96, 128), seed=1):
    from PIL import Image
    rng = np.random.default_rng(seed)
    paths = []
    for c in range(classes):
        d = Path(root) / f"class{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            p = d / f"{i:03d}.jpg"
            Image.fromarray(_smooth(size[0], size[1], rng)).save(p, quality=90)
            paths.append(p.relative_to(root).as_posix())
    return paths


def read_concurrently(mount, names, readers=16, seed=0):
    """Each reader takes names from one shuffled list; returns {name: bytes or errno}."""
    order = list(names)
    random.Random(seed).shuffle(order)
    lock = threading.Lock()
    out = {}

    def worker():
        while True:
            with lock:
                if not order:
                    return
                name = order.pop()
            try:
                data = (mount.path / name).read_bytes()
            except OSError as e:
                data = e.errno
            with lock:
                out[name] = data

    threads = [threading.Thread(target=worker) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_readers_single_flight(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src)
    # split 6, not the policy's choice: a profile timed under load may choose another
    m = mounter(src, model=models(), batch=8, batch_wait=20, split=6)
    feats = [p + ".feat" for p in paths]
    # every file asked for by two readers at once, 16 readers in all
    got = read_concurrently(m, feats + feats, readers=16)
    again = read_concurrently(m, feats, readers=16, seed=1)
    for f in feats:
        assert isinstance(got[f], bytes) and got[f] == again[f]
        assert np.load(m.path / f).shape == (512,)
    st = m.ctl("stats")
    assert st["feat"]["computed"] == len(paths), st   # each sample computed once
    assert st["batcher"]["samples"] == len(paths)
    assert st["batcher"]["batches"] < len(paths)     # demand was batched
    assert st["batcher"]["mean_batch"] > 1.5, st["batcher"]
    # the bytes are the features of each image, whatever batch they were in
    archive = models()
    for p in paths[:6]:
        ref = reference_features(archive, src / p, 6)
        got16 = np.load(m.path / (p + ".feat")).astype(np.float32)
        np.testing.assert_allclose(got16, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


def test_corrupt_batch_mate_fails_alone(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=1, per_class=7)
    bad = ["class0/bad1.jpg", "class0/bad2.jpg"]
    good = (src / paths[0]).read_bytes()
    (src / bad[0]).write_bytes(good[: len(good) // 3])
    (src / bad[1]).write_bytes(b"\xff\xd8\xff" + os.urandom(500))
    m = mounter(src, model=models(), batch=16, batch_wait=200)
    got = read_concurrently(m, [p + ".feat" for p in paths + bad], readers=9)
    for p in paths:
        assert isinstance(got[p + ".feat"], bytes), p
    for p in bad:
        assert got[p + ".feat"] == errno.EIO, p
    st = m.ctl("stats")
    assert st["feat"]["computed"] == len(paths)
    # they were batched together (how many batches depends on when each reader's request
    # arrives: under load a late one makes a batch of its own)
    assert st["batcher"]["batches"] < len(paths), st["batcher"]


def test_fast_mode_parity(tmp_path, models, mounter):
    from PIL import Image
    rng = np.random.default_rng(5)
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i, (h, w) in enumerate([(480, 640), (375, 500), (768, 1024), (1031, 481)]):
        Image.fromarray(_smooth(h, w, rng)).save(src / f"{i}.jpg", quality=90)
    archive = models("resnet18", 112)
    fast = mounter(tmp_path / "src", model=archive, preprocess="fast", dtype="fp32")
    exact = mounter(tmp_path / "src", model=archive, dtype="fp32")
    assert fast.ctl("config")["cache"]["namespace"] != exact.ctl("config")["cache"]["namespace"]
    for i in range(4):
        f = np.load(fast.path / "c" / f"{i}.jpg.feat").ravel().astype(np.float64)
        e = np.load(exact.path / "c" / f"{i}.jpg.feat").ravel().astype(np.float64)
        ref = reference_features(archive, src / f"{i}.jpg", 6).ravel()
        assert np.allclose(e, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
        cos = f @ ref / np.linalg.norm(f) / np.linalg.norm(ref)
        assert cos >= 0.995, (i, cos)


def test_bf16_parity_and_namespace(tmp_path, models, mounter):
    """precision=bf16: features close to the fp32 reference, at pool and at an earlier split,
    in a namespace of their own, with their own profile."""
    rng = np.random.default_rng(6)
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    from PIL import Image
    for i in range(3):
        Image.fromarray(_smooth(120, 150, rng)).save(src / f"{i}.jpg", quality=90)
    archive = models("resnet18", 64)
    for split in (6, 4):
        bf = mounter(tmp_path / "src", model=archive, precision="bf16", dtype="fp32", split=split,
                     own_profile=True)
        fp = mounter(tmp_path / "src", model=archive, dtype="fp32", split=split)
        cb, cf = bf.ctl("config"), fp.ctl("config")
        assert cb["model"]["precision"] == "bf16" and cf["model"]["precision"] == "fp32"
        assert cb["cache"]["namespace"] != cf["cache"]["namespace"]
        for i in range(3):
            b = np.load(bf.path / "c" / f"{i}.jpg.feat").ravel().astype(np.float64)
            f = np.load(fp.path / "c" / f"{i}.jpg.feat").ravel().astype(np.float64)
            ref = reference_features(archive, src / f"{i}.jpg", split).ravel()
            assert np.allclose(f, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
            cos = b @ ref / np.linalg.norm(b) / np.linalg.norm(ref)
            assert cos >= 0.995, (split, i, cos)
            assert not np.array_equal(b, f)   # it did run in bf16
        assert bf.ctl("stats")["feat"]["computed"] == 3
        bf.unmount()
        fp.unmount()
    profiles = sorted(p.name for p in (tmp_path / "cache").glob("profile-*.json"))
    assert any(re.search(r"-cpu-bf16-[\w-]+-t\d+\.json$", n) for n in profiles), profiles
    assert any(re.search(r"-cpu-(?!bf16-)[\w-]+-t\d+\.json$", n) for n in profiles), profiles


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_inference_workers_share_the_threads(tmp_path, models, mounter, precision):
    """inference_workers=2: two inference threads run their own batches of one model at once,
    each with torch_threads / 2 threads (the profile measured so), every image computed once
    and right, in each precision."""
    src = tmp_path / "src"
    paths = make_tree(src, classes=2, per_class=12)
    m = mounter(src, model=models(), batch=4, split=6, torch_threads=2, inference_workers=2,
                prefetch="off", precision=precision, cache=str(tmp_path / "cache"))
    assert m.ctl("config")["runtime"]["inference_workers"] == 2
    feats = [p + ".feat" for p in paths]
    got = read_concurrently(m, feats + feats, readers=16)
    names = [(t / "comm").read_text().strip() for t in Path(f"/proc/{m.pid}/task").iterdir()]
    assert names.count("hapifs-infer") >= 2, names
    st = m.ctl("stats")
    assert st["feat"]["computed"] == len(paths), st
    assert st["batcher"]["samples"] == len(paths)
    archive = models()
    for p in paths:
        ref = reference_features(archive, src / p, 6)
        feat = np.load(m.path / (p + ".feat")).astype(np.float32)
        assert isinstance(got[p + ".feat"], bytes)
        if precision == "fp32":
            np.testing.assert_allclose(feat, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
        else:
            g, w = feat.ravel().astype(np.float64), ref.ravel().astype(np.float64)
            assert g @ w / np.linalg.norm(g) / np.linalg.norm(w) >= 0.99, (precision, p)
    m.unmount()
    profiles = [p.name for p in (tmp_path / "cache").glob("profile-*.json")]
    assert any(n.endswith("-t1.json") for n in profiles), profiles  # one worker's threads


@pytest.mark.parametrize("opts,why", [
    ({"inference_workers": "0"}, "inference_workers=0"),
    ({"inference_workers": "65"}, "inference_workers=65"),
])
def test_bad_inference_workers_are_refused(tmp_path, models, mounter, opts, why):
    (tmp_path / "src").mkdir()
    with pytest.raises(RuntimeError, match=why):
        mounter(tmp_path / "src", model=models(), **opts)


@pytest.mark.parametrize("opts,why", [
    ({"precision": "fp8"}, "precision=fp8: expected fp32, bf16, int8 or auto"),
    ({"precision": "bf16", "device": "cuda"}, "precision=bf16 runs on the CPU only"),
    ({"precision": "int8", "device": "cuda"}, "precision=int8 runs on the CPU only"),
])
def test_bad_precision_is_refused(tmp_path, models, mounter, opts, why):
    (tmp_path / "src").mkdir()
    with pytest.raises(RuntimeError, match=why):
        mounter(tmp_path / "src", model=models(), **opts)


def wait_for(fn, timeout=60, step=0.05):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(step)
    return fn()


def test_prefetch_fills_the_directory_of_a_miss(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=2, per_class=10, size=(64, 80))
    m = mounter(src, model=models())
    first = "class0/000.jpg.feat"
    (m.path / first).read_bytes()
    # the rest of class0 is computed in the background; class1 is left alone
    done = wait_for(lambda: m.ctl("stats")["prefetch"]["computed"] == 9)
    st = m.ctl("stats")
    assert done, st["prefetch"]
    p = st["prefetch"]
    # (the read's own file may still be in flight when the walk reaches it: that one joins it)
    assert p["mode"] == "dir" and p["dirs"] == 1 and p["submitted"] in (9, 10), p
    assert st["feat"]["computed"] == 10 and st["feat"]["misses"] == 1, st["feat"]
    assert st["batcher"]["mean_batch"] > 1.5, st["batcher"]     # prefetch runs in batches
    # every read of the directory is now a hit, equal to a mount without prefetch
    off = mounter(src, model=models(), prefetch="off", cache=str(tmp_path / "other"))
    for rel in [q for q in paths if q.startswith("class0/")]:
        assert (m.path / (rel + ".feat")).read_bytes() == (off.path / (rel + ".feat")).read_bytes()
    st = m.ctl("stats")
    assert st["feat"]["misses"] == 1 and st["feat"]["computed"] == 10, st["feat"]
    assert st["cache"]["namespace"]["entries"] == 10
    # a second miss in the same directory does not walk it again; one in class1 does
    (m.path / "class1/003.jpg.feat").read_bytes()
    assert wait_for(lambda: m.ctl("stats")["prefetch"]["computed"] == 18)
    assert m.ctl("stats")["prefetch"]["dirs"] == 2
    assert m.ctl("config")["runtime"]["prefetch"] == "dir"


def test_prefetch_off_computes_only_what_is_read(tmp_path, models, mounter):
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=8, size=(64, 80))
    m = mounter(src, model=models(), prefetch="off")
    (m.path / "class0/000.jpg.feat").read_bytes()
    time.sleep(1.5)
    st = m.ctl("stats")
    assert st["feat"]["computed"] == 1, st["feat"]
    assert st["prefetch"]["mode"] == "off" and st["prefetch"]["submitted"] == 0, st["prefetch"]


def test_prefetch_stays_off_when_the_tree_outgrows_the_cache(tmp_path, models, mounter):
    src = tmp_path / "src"
    # 500 images at no less than 1.3 KiB of store each (hapi_cache_entry_bytes of a 1,024-byte
    # feature): more than half of a 1 MiB cache
    make_tree(src, classes=2, per_class=250, size=(32, 40))
    m = mounter(src, model=models(), cache_size="1M")
    (m.path / "class0/000.jpg.feat").read_bytes()
    assert wait_for(lambda: m.ctl("stats")["prefetch"]["dropped"] == 1, timeout=30)
    st = m.ctl("stats")
    assert st["feat"]["computed"] == 1 and st["prefetch"]["submitted"] == 0, st
    assert "prefetch is off at split" in m.log_text()


def test_prefetch_failure_is_an_error_only_when_read(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=1, per_class=5, size=(64, 80))
    (src / "class0/zbad.jpg").write_bytes(b"\xff\xd8\xff" + os.urandom(300))
    m = mounter(src, model=models())
    (m.path / (paths[0] + ".feat")).read_bytes()
    assert wait_for(lambda: m.ctl("stats")["batcher"]["failed"] == 1)
    assert wait_for(lambda: m.ctl("stats")["prefetch"]["computed"] == 4)
    st = m.ctl("stats")
    assert st["feat"]["failed"] == 0, st["feat"]
    assert m.ctl("errors")["count"] == 0
    with pytest.raises(OSError) as e:
        (m.path / "class0/zbad.jpg.feat").read_bytes()
    assert e.value.errno == errno.EIO
    assert m.ctl("stats")["feat"]["failed"] >= 1
    assert any("zbad.jpg" in (x["path"] or "") for x in m.ctl("errors")["errors"])


def vm_hwm_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def reset_hwm(pid):
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def test_memory_budget_holds(tmp_path, models, mounter):
    from PIL import Image
    rng = np.random.default_rng(9)
    src = tmp_path / "src" / "big"
    src.mkdir(parents=True)
    # 24 images of 2000x1500: 9 MB each once decoded, 216 MB if all were in flight at once
    for i in range(24):
        Image.fromarray(_smooth(1500, 2000, rng)).save(src / f"{i}.jpg", quality=85)
    # four decode threads would hold ~36 MB of images at once; the budget allows two
    budget = 20 << 20
    m = mounter(tmp_path / "src", model=models(), mem="20M", batch=4, decode_threads=4,
                batch_wait=1)
    np.load(m.path / "big" / "0.jpg.feat")  # the model's arenas exist now
    baseline = vm_hwm_kib(m.pid) * 1024
    reset_hwm(m.pid)
    got = read_concurrently(m, [f"big/{i}.jpg.feat" for i in range(1, 24)], readers=16)
    assert all(isinstance(v, bytes) for v in got.values())
    peak = vm_hwm_kib(m.pid) * 1024
    st = m.ctl("stats")["batcher"]
    print(f"baseline {baseline >> 20} MiB, peak {peak >> 20} MiB, accounted peak "
          f"{st['mem_peak'] >> 20} MiB, waits {st['mem_waits']}")
    assert st["mem_peak"] <= budget + (10 << 20)  # admission is on an estimate: one sample over
    assert st["mem_waits"] > 0                     # backpressure happened
    assert peak - baseline <= budget + (32 << 20), (peak - baseline) >> 20


def wait_warm(m, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        w = m.ctl("stats")["warm"]
        if w["state"] == "done":
            return w
        time.sleep(0.2)
    raise AssertionError(f"warm-up did not finish: {w}")


def test_warm_at_mount_and_by_command(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=3, per_class=8)
    m = mounter(src, model=models(), warm=1)
    w = wait_warm(m)
    assert w["total"] == len(paths) and w["done"] == len(paths)
    assert w["computed"] == len(paths) and w["eta_s"] == 0
    st = m.ctl("stats")
    assert st["feat"]["computed"] == len(paths)
    for p in paths:
        np.load(m.path / (p + ".feat"))
    assert m.ctl("stats")["feat"]["misses"] == 0  # every read was a hit after warm-up
    # a second warm-up finds everything cached
    (m.path / ".hapifs" / "ctl").write_text("warm class1\n")
    w = wait_warm(m)
    assert w["path"] == "class1" and w["total"] == 8 and w["cached"] == 8 and w["computed"] == 0


def test_ctl_refuses_bad_commands(tmp_path, models, mounter):
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=2)
    m = mounter(src, model=models())
    ctl = m.path / ".hapifs" / "ctl"
    assert "warm" in ctl.read_text()
    for bad in ["frobnicate\n", "warm a b c\n", "warm ../etc\n", "warm nosuchdir\n",
                "warm " + "x" * 5000 + "\n"]:
        with pytest.raises(OSError) as e:
            with open(ctl, "w") as f:
                f.write(bad)
        assert e.value.errno in (errno.EINVAL, errno.ENOENT), bad
    assert m.ctl("stats")["warm"]["state"] == "idle"
    with pytest.raises(OSError) as e:
        (m.path / ".hapifs" / "config").write_text("x")
    assert e.value.errno == errno.EROFS


def test_readdirplus_listing_matches_stat(tmp_path, models, mounter):
    src = tmp_path / "src"
    make_tree(src, classes=2, per_class=5)
    m = mounter(src, model=models())
    for entry in os.scandir(m.path / "class0"):
        st = entry.stat()
        assert st.st_size == m.ctl("config")["split"]["feat_size"]
        assert st.st_ino == os.stat(entry.path).st_ino
