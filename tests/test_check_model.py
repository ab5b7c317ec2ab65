"""bench/check-model: every stage of an archive against eager torchvision."""
import json
import subprocess

import torch

from conftest import EXPORTER, PYTHON, SOURCE_ROOT

CHECK = SOURCE_ROOT / "bench" / "check-model"


def run(*args):
    return subprocess.run([PYTHON, str(CHECK), *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_every_stage_compared(tmp_path):
    r = run("mobilenet_v3_small", "--input-size", "64", "--images", "2", "--keep", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    archive = tmp_path / "mobilenet_v3_small-64.pt"
    extra = {"hapifs.json": ""}
    torch.jit.load(str(archive), _extra_files=extra)
    stages = json.loads(extra["hapifs.json"])["stages"]
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("  ")][1:]
    assert [row[0] for row in rows] == stages
    assert all(float(row[-2]) >= 0.99999 for row in rows), r.stdout
    assert "1 ok, 0 failed" in r.stdout


def test_an_archive_that_is_not_its_model_fails(tmp_path):
    """An archive whose metadata names other weights than it holds: the check can fail."""
    good = tmp_path / "r.pt"
    r = subprocess.run([PYTHON, str(EXPORTER), "resnet18", "-o", str(good), "-q",
                        "--input-size", "32", "--seed", "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    extra = {"hapifs.json": ""}
    model = torch.jit.load(str(good), _extra_files=extra)
    meta = json.loads(extra["hapifs.json"])
    meta["weights"] = "random:seed=2"
    bad = tmp_path / "bad.pt"
    torch.jit.save(model, str(bad), _extra_files={"hapifs.json": json.dumps(meta)})
    r = run(good, "--images", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(bad, "--images", "2")
    assert r.returncode == 1 and "cosine below 0.99999 at stem" in r.stdout, r.stdout
