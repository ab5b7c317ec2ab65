"""bench/check-model: every stage of an archive against eager torchvision, in Python and
through a real mount in fp32 and bf16."""
import json
import subprocess

import pytest
import torch

from conftest import BUILD_ROOT, EXPORTER, HAPIFS, PYTHON, SOURCE_ROOT, need_hapifs

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


def test_the_c_sides_features_are_compared_too(tmp_path):
    """--hapi-features: the daemon's own decode, preprocessing and libtorch, without a mount,
    against eager torchvision at every stage; an extra column per stage, checked by the bound."""
    tool = BUILD_ROOT / "tests" / "hapi-features"
    if not tool.exists():
        pytest.skip(f"{tool} is not built (set HAPI_BUILD_ROOT)")
    r = run("resnet18", "--input-size", "32", "--images", "2", "--hapi-features", tool)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    head = next(line for line in lines if line.startswith("  stage"))
    assert "C cos" in head, head
    rows = [line.split() for line in lines if line.startswith("  ") and line is not head]
    assert [row[0] for row in rows] == ["stem", "layer1", "layer2", "layer3", "layer4", "pool",
                                        "fc"], r.stdout
    # the C side's fp32 features, its own exact-mode preprocessing included, equal eager's
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


def table(stdout):
    """The per-stage lines of check-model's table: {stage: {column: value}}, the columns named
    cosine, rel, fp32_cos, fp32_abs, bf16_cos, bf16_abs, ref, bf16_runs (the precision a bf16
    mount ran the stage in), check_cos (those there are)."""
    lines = [line for line in stdout.splitlines() if line.startswith("  ")]
    head = lines[0]
    for words, name in (("max rel err", "rel"), ("max |ref|", "ref"), ("fp32 cos", "fp32_cos"),
                        ("fp32 abs err", "fp32_abs"), ("bf16 cos", "bf16_cos"),
                        ("bf16 abs err", "bf16_abs"), ("bf16 runs in", "bf16_runs"),
                        ("(check cos)", "check_cos")):
        head = head.replace(words, name)
    named = head.split()[2:]  # after stage and shape, whose "(64, 8, 8)" has blanks

    def value(word):
        return word if word in ("bf16", "fp32") else float(word)
    return {line.split()[0]: dict(zip(named, map(value, line.split()[-len(named):])))
            for line in lines[1:]}


@pytest.mark.parametrize("arch,size", [("resnet18", 32), ("efficientnet_b0", 64)])
def test_mounted_features_match_eager_in_fp32_and_bf16(tmp_path, arch, size):
    """Every stage read through a mount (the daemon's own decode, bilinear or bicubic resize,
    libtorch) against eager torchvision: fp32 within cosine 0.99999, bf16 within 0.999 and
    really computed in bf16 (an error well above fp32's), every stage kept in bf16 by the
    mount's check."""
    need_hapifs()
    r = run(arch, "--input-size", size, "--images", "2", "--mount", "--hapifs", HAPIFS,
            "--keep", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    extra = {"hapifs.json": ""}
    torch.jit.load(str(tmp_path / f"{arch}-{size}.pt"), _extra_files=extra)
    rows = table(r.stdout)
    assert list(rows) == json.loads(extra["hapifs.json"])["stages"]
    for stage, row in rows.items():
        assert row["fp32_cos"] >= 0.99999 and row["bf16_cos"] >= 0.999, (stage, row)
        assert row["fp32_abs"] <= 1e-4 * row["ref"], (stage, row)
        assert row["bf16_abs"] > 10 * row["fp32_abs"], (stage, row)
        assert row["bf16_runs"] == "bf16" and 0.9995 <= row["check_cos"] <= 1.0 + 1e-9, row
    assert "mounted in fp32" in r.stdout and "1 ok, 0 failed" in r.stdout


def test_a_mounted_stage_below_its_bound_fails_the_model():
    """bf16 cannot reach a bound fp32 reaches: the model fails, naming the stages."""
    need_hapifs()
    r = run("resnet18", "--input-size", "32", "--images", "1", "--mount", "--hapifs", HAPIFS,
            "--precision", "bf16", "--min-cosine-bf16", "0.9999999")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED: cosine below 0.99999 (bf16: 0.9999999) at stem (bf16)" in r.stdout, r.stdout
    assert "0 ok, 1 failed" in r.stdout
