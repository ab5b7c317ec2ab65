"""The main job on a small scale: sample dataset, staged model, mount, examples/train.py learns.

At the pooling split the features go straight into the head; at an earlier split train.py
runs the frozen stages [split, freeze) itself (its trunk), from the archive it is given or
finds, and must learn as well.
"""
import json
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import PYTHON, SOURCE_ROOT, load_tool

TRAIN = SOURCE_ROOT / "examples" / "train.py"


def load_train():
    """examples/train.py as a module (it is a script, not a package)."""
    return load_tool("examples/train.py")


def settled_config(m, timeout=120):
    """The mount's config once its split is chosen (right after mounting it may not be)."""
    end = time.monotonic() + timeout
    while True:
        cfg = m.ctl("config")
        if "index" in cfg["split"] or time.monotonic() > end:
            return cfg
        time.sleep(0.1)


def make_dataset(out, classes, per_class, size=None):
    cmd = [PYTHON, str(SOURCE_ROOT / "examples" / "make-dataset"), str(out),
           "--classes", str(classes), "--per-class", str(per_class)]
    if size:
        cmd += ["--size", str(size)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def train(root, epochs, *extra):
    r = subprocess.run([PYTHON, str(TRAIN), str(root), "--epochs", str(epochs),
                        "--workers", "2", *map(str, extra)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    return r.stdout


def assert_learned(out, epochs):
    got = re.findall(rf"^epoch (\d+)/{epochs} .*val_acc ([0-9.]+)", out, re.M)
    assert len(got) == epochs
    final = re.search(r"final val_acc ([0-9.]+) \(chance ([0-9.]+)\)", out)
    acc, chance = float(final.group(1)), float(final.group(2))
    assert acc >= 0.6 and acc >= chance + 0.25, out
    return acc, chance


def test_train_on_mounted_features(tmp_path, models, mounter):
    data = make_dataset(tmp_path / "data", 4, 60)
    m = mounter(data, model=models("resnet18", 112))
    out = train(m.path, 10)
    assert re.search(r"^trunk: none$", out, re.M), out
    assert_learned(out, 10)
    st = m.ctl("stats")
    assert st["feat"]["computed"] == 240
    assert st["feat"]["failed"] == 0


def check_report(report, cfg, epochs, acc, source):
    a, b = cfg["split"]["stages_after"]
    names = [s["name"] for s in cfg["model"]["stages"]]
    trunk = report["trunk"]
    assert trunk["stages"] == [a, b] and trunk["names"] == names[a:b]
    assert trunk["source"] == str(source)
    assert "stage names" in trunk["checked"] and "shapes" in trunk["checked"]
    assert trunk["ms_per_sample"] > 0 and set(trunk["ms_per_sample_by_stage"]) == set(names[a:b])
    assert [e["epoch"] for e in report["epochs"]] == list(range(1, epochs + 1))
    for e in report["epochs"]:
        assert e["wall_s"] >= e["train_s"] > 0 and e["samples_per_s"] > 0
        assert e["train_samples"] > 0 and e["trunk_ms_per_sample"] > 0
    assert report["final_val_acc"] == pytest.approx(acc, abs=5e-4)
    assert report["feature_shape"] == cfg["split"]["shape"]
    assert report["feature_dtype"] == cfg["split"]["dtype"]


def test_train_at_an_early_split_runs_the_frozen_stages(tmp_path, models, mounter):
    """split=3 (features after layer2, fp16): train.py runs layer3, layer4, pool itself."""
    archive = models("resnet18", 64)
    data = make_dataset(tmp_path / "data", 4, 40, size=80)
    m = mounter(data, model=archive, split=3)
    cfg = settled_config(m)
    assert cfg["split"]["stages_after"] == [3, cfg["split"]["freeze"]] == [3, 6]
    report = tmp_path / "report.json"
    out = train(m.path, 10, "--model", archive, "--report", report)
    assert re.search(r"^trunk: stages \[3, 6\) \(layer3, layer4, pool\) ", out, re.M), out
    assert re.search(r"^trunk: [0-9.]+ ms/sample over \d+ samples in epoch 1 \(layer3 ", out,
                     re.M), out
    acc, _ = assert_learned(out, 10)
    check_report(json.loads(report.read_text()), cfg, 10, acc, archive)
    assert m.ctl("stats")["feat"]["computed"] == 160


def test_train_on_a_remote_mount_runs_no_trunk(tmp_path, models, mounter):
    """A compute-side mount (features=freeze by default) finishes the stages [split, freeze)
    itself: train.py, unmodified, runs no trunk on an early storage split's features, and
    learns."""
    archive = models("resnet18", 64)
    data = make_dataset(tmp_path / "data", 4, 40, size=80)
    st = mounter(data, model=archive, split=3)
    settled_config(st)
    r = mounter(st.path, tmp_path / "remote", remote=None, cache=str(tmp_path / "rcache"))
    out = train(r.path, 10)
    assert re.search(r"^trunk: none$", out, re.M), out
    assert_learned(out, 10)
    assert r.ctl("stats")["feat"]["computed"] == 160


def test_train_at_an_early_split_loads_the_mounts_model(tmp_path, models, mounter):
    """--model auto takes the stages from the mount's .hapifs/model (what sshfs shows)."""
    archive = models("resnet18", 64)
    data = make_dataset(tmp_path / "data", 4, 40, size=80)
    m = mounter(data, model=archive, split="layer3")
    served = m.path / ".hapifs" / "model"
    assert served.read_bytes() == archive.read_bytes()
    cfg = settled_config(m)
    assert cfg["split"]["stages_after"] == [4, 6]
    report = tmp_path / "report.json"
    out = train(m.path, 10, "--report", report)
    assert re.search(r"^trunk: stages \[4, 6\) \(layer4, pool\) ", out, re.M), out
    acc, _ = assert_learned(out, 10)
    check_report(json.loads(report.read_text()), cfg, 10, acc, served)


def test_trunk_first_reads_no_feature_before_the_trunk_is_set_up(tmp_path, models, mounter):
    """--trunk-first: the trunk is built from the config's split shape before the first read;
    by default the first feature is read first (the storage node starts meanwhile)."""
    train_py = load_train()
    archive = models("resnet18", 64)
    data = make_dataset(tmp_path / "data", 2, 8, size=80)
    m = mounter(data, model=archive, split="layer3")
    cfg = settled_config(m)
    seen = []
    resolve = train_py.resolve_trunk

    def watched(*a, **kw):
        seen.append(m.ctl("stats")["feat"]["computed"])
        return resolve(*a, **kw)

    train_py.resolve_trunk = watched
    for first in (True, False):
        report = tmp_path / f"report-{first}.json"
        argv = [str(m.path), "--epochs", "1", "--workers", "0", "--report", str(report)]
        assert train_py.main(argv + ["--trunk-first"] * first) == 0
        rep = json.loads(report.read_text())
        assert rep["trunk"]["names"] == ["layer4", "pool"] and rep["trunk"]["optimized"]
        assert rep["feature_shape"] == cfg["split"]["shape"]
    assert seen[0] == 0 and seen[1] >= 1, seen

    # a feature that is not of the split's shape is still caught, after the trunk
    remote = tmp_path / "remote"
    shutil.copytree(m.path, remote / "train")
    (remote / ".hapifs").mkdir()
    shutil.copyfile(archive, remote / ".hapifs" / "model")
    cfg["split"]["shape"] = [cfg["split"]["shape"][0], 8, 8]
    (remote / ".hapifs" / "config").write_text(json.dumps(cfg))
    r = subprocess.run([PYTHON, str(TRAIN), str(remote / "train"), "--workers", "0",
                        "--trunk-first"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "but the mount's split gives" in r.stderr and "(256, 4, 4)" in r.stderr, r.stderr
    # a config that cannot be read is a message too, not a traceback
    (remote / ".hapifs" / "config").write_text("{not json")
    r = subprocess.run([PYTHON, str(TRAIN), str(remote / "train"), "--workers", "0",
                        "--trunk-first"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith("train.py: "), r.stderr
    assert "cannot read the mount's config" in r.stderr and "Traceback" not in r.stderr


def test_trunk_on_early_features_equals_features_at_the_freeze_split(tmp_path, models, mounter):
    """Features at split 3 run through train.py's trunk == the mount's features at freeze (fp32)."""
    train_py = load_train()
    archive = models("resnet18", 64)
    data = make_dataset(tmp_path / "data", 2, 8, size=80)
    early = mounter(data, model=archive, split=3, dtype="fp32")
    full = mounter(data, model=archive, dtype="fp32")
    cfg = settled_config(early)
    a, b = cfg["split"]["stages_after"]
    assert (a, b) == (3, 6) and settled_config(full)["split"]["index"] == b
    files = sorted(p.relative_to(early.path) for p in early.path.rglob("*.feat"))
    assert len(files) == 16
    x = np.stack([np.load(early.path / f) for f in files])
    ref = np.stack([np.load(full.path / f) for f in files])
    assert x.dtype == ref.dtype == np.float32
    assert x.shape[1:] == tuple(cfg["split"]["shape"]) == (128, 8, 8)

    trunk = train_py.build_trunk(archive, a, b, config=cfg)
    assert (trunk.start, trunk.stop, trunk.names) == (3, 6, ["layer3", "layer4", "pool"])
    assert not any(p.requires_grad for p in trunk.parameters()) and not trunk.training
    got = trunk(train_py.to_float_tensor(x)).numpy()
    assert got.shape == ref.shape == (16, 512)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # the same through the plain stages (not frozen and fused), and found by resolve_trunk
    plain = train_py.build_trunk(archive, a, b, config=cfg, optimize=False)
    assert plain.optimized == []
    np.testing.assert_allclose(plain(train_py.to_float_tensor(x)).numpy(), ref, rtol=1e-4,
                               atol=1e-4 * np.abs(ref).max())
    found = train_py.resolve_trunk(early.path, model=str(archive), feature_shape=x.shape[1:])
    assert (found.start, found.stop) == (3, 6)


def test_trunk_needs_the_right_archive(tmp_path, models, mounter):
    """The archive is checked against the mount; auto without one says to pass --model."""
    train_py = load_train()
    archive = models("resnet18", 64)
    data = make_dataset(tmp_path / "data", 2, 2, size=80)
    m = mounter(data, model=archive, split="layer3")
    cfg = settled_config(m)
    other_weights, other_arch = models("resnet18", 64, seed=1), models("resnet34", 64)
    for wrong, why in ((other_arch, "resnet34"), (other_weights, "XXH3-128")):
        with pytest.raises(train_py.TrunkError, match=why):
            train_py.resolve_trunk(m.path, model=str(wrong))
    assert "digest" in train_py.resolve_trunk(m.path, model=str(archive)).checked
    with pytest.raises(train_py.TrunkError, match="split 4"):
        train_py.resolve_trunk(m.path, model=str(archive), split="3")
    assert train_py.resolve_trunk(m.path, model="none").names == []

    # a compute node that sees the mount's config but neither .hapifs/model nor the archive;
    # ROOT is a folder below the mount's top, where .hapifs is
    remote = tmp_path / "remote"
    (remote / ".hapifs").mkdir(parents=True)
    cfg["model"]["path"] = str(tmp_path / "not-here.pt")
    (remote / ".hapifs" / "config").write_text(json.dumps(cfg))
    shutil.copytree(m.path, remote / "train")
    with pytest.raises(train_py.TrunkError, match="--model PATH"):
        train_py.resolve_trunk(remote / "train")
    r = subprocess.run([PYTHON, str(TRAIN), str(remote / "train"), "--workers", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith("train.py: ") and "--model PATH" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert train_py.resolve_trunk(remote / "train", model=str(archive)).names == ["layer4", "pool"]
    # ... and once the mount serves its model, auto takes it from there
    shutil.copyfile(archive, remote / ".hapifs" / "model")
    served = train_py.resolve_trunk(remote / "train")
    assert served.source == str(remote / ".hapifs" / "model") and "digest" in served.checked
    r = subprocess.run([PYTHON, str(TRAIN), str(remote / "train"), "--workers", "0",
                        "--epochs", "1", "--val-fraction", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "trunk: stages [4, 6) (layer4, pool) of resnet18 from " + str(remote) in r.stdout

    # plain .npy files, no config: only with --model and --split
    plain = tmp_path / "plain"
    shutil.copytree(m.path, plain)
    assert train_py.resolve_trunk(plain).names == []
    with pytest.raises(train_py.TrunkError, match="--split"):
        train_py.resolve_trunk(plain, model=str(archive))
    t = train_py.resolve_trunk(plain, model=str(archive), split="layer3",
                               feature_shape=(256, 4, 4))
    assert (t.start, t.stop, t.names) == (4, 6, ["layer4", "pool"])


def test_a_split_changed_under_training_is_reported(tmp_path, models, mounter):
    """The split of a live mount can change (hapifs-ctl split N): the trunk no longer fits."""
    train_py = load_train()
    archive = models("resnet18", 64)
    data = make_dataset(tmp_path / "data", 2, 2, size=80)
    m = mounter(data, model=archive, split="layer3")
    trunk = train_py.resolve_trunk(m.path, model=str(archive))
    assert trunk.split["index"] == 4 and train_py.split_changed(trunk) is None
    (m.path / ".hapifs" / "ctl").write_text("split 6\n")
    end = time.monotonic() + 30
    while settled_config(m)["split"]["index"] != 6 and time.monotonic() < end:
        time.sleep(0.1)
    msg = train_py.split_changed(trunk)
    assert msg and "from 4 (layer3) to 6 (pool)" in msg


KEEP_HEAP_PROBE = """
import resource, sys, torch
sys.path.insert(0, sys.argv[1])
import train
kept = sys.argv[2] == "keep" and train.keep_heap()
def batch():  # a 48 MiB activation, above glibc's largest mmap threshold, written
    torch.empty(12 << 20).fill_(1.0)
# torch's 64-byte-aligned blocks settle in the heap after a few batches: measured here, a new
# 48 MiB block (12,288 faults) in up to 5 of the first 6 batches, none after the sixth
for _ in range(10):
    batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    batch()
print(int(kept), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("mode", ["keep", "plain"])
def test_keep_heap_reuses_a_batchs_memory(mode):
    """train.py's trunk keeps freed tensors' memory for the next batch (keep_heap): glibc's
    default maps a large block anew at every batch and faults it in page by page."""
    r = subprocess.run([PYTHON, "-c", KEEP_HEAP_PROBE, str(TRAIN.parent), mode],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    kept, faults = map(int, r.stdout.split())
    if mode == "keep":
        assert kept == 1 and faults < 200, r.stdout
    else:  # the contrast: without it each batch faults its 12,288 pages in again
        assert faults >= 4 * 10000, r.stdout
