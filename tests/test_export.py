"""hapifs-export-model: the staged archive format, its metadata, seeds and --weights."""
import json
import subprocess

import pytest
import torch
import torchvision

from conftest import EXPORTER, PYTHON

CASES = [
    # arch, input size, stage names, freeze index
    ("resnet18", 64, ["stem", "layer1", "layer2", "layer3", "layer4", "pool", "fc"], 6),
    ("resnet50", 64, ["stem", "layer1", "layer2", "layer3", "layer4", "pool", "fc"], 6),
    ("vgg16", 64, None, None),
    ("vit_b_16", 32, None, None),
]


def export(arch, out, *args):
    return subprocess.run([PYTHON, str(EXPORTER), arch, "-o", str(out), "-q", *args],
                          capture_output=True, text=True, timeout=600)


def load(path):
    extra = {"hapifs.json": ""}
    m = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    return m, json.loads(extra["hapifs.json"])


def run_stages(model, x, upto=None):
    with torch.no_grad():
        for i, (_, stage) in enumerate(model.named_children()):
            if upto is not None and i >= upto:
                break
            x = stage(x)
    return x


@pytest.mark.parametrize("arch,size,names,freeze", CASES)
def test_staged_archive_equals_torchvision(tmp_path, arch, size, names, freeze):
    out = tmp_path / f"{arch}.pt"
    r = export(arch, out, "--input-size", str(size), "--seed", "3", "--num-classes", "10")
    assert r.returncode == 0, r.stderr
    model, meta = load(out)
    children = [n for n, _ in model.named_children()]
    assert meta["format"] == "hapifs-staged" and meta["arch"] == arch
    assert meta["stages"] == children
    if names:
        assert children == names
    if freeze:
        assert meta["freeze"] == freeze
    assert 0 < meta["freeze"] < len(children)
    assert meta["input_size"] == size and meta["resize_size"] == round(size * 256 / 224)
    assert meta["mean"] == pytest.approx([0.485, 0.456, 0.406])
    assert meta["std"] == pytest.approx([0.229, 0.224, 0.225])
    # the stages in order compute what torchvision's model computes
    torch.manual_seed(3)
    kw = {"image_size": size} if arch.startswith("vit") else {}
    ref_model = getattr(torchvision.models, arch)(weights=None, num_classes=10, **kw).eval()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(x)
    got = run_stages(model, x)
    assert got.shape == ref.shape == (2, 10)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


def test_seed_and_weights(tmp_path):
    a, b, c = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "c.pt"
    assert export("resnet18", a, "--input-size", "64", "--seed", "5").returncode == 0
    assert export("resnet18", b, "--input-size", "64", "--seed", "5").returncode == 0
    assert export("resnet18", c, "--input-size", "64", "--seed", "6").returncode == 0
    x = torch.randn(1, 3, 64, 64)
    fa, fb, fc = (run_stages(load(p)[0], x) for p in (a, b, c))
    assert torch.equal(fa, fb)
    assert not torch.allclose(fa, fc)
    # --weights: a given state_dict is what the archive computes
    torch.manual_seed(11)
    trained = torchvision.models.resnet18(weights=None).eval()
    sd = tmp_path / "sd.pt"
    torch.save(trained.state_dict(), sd)
    w = tmp_path / "w.pt"
    r = export("resnet18", w, "--input-size", "64", "--weights", str(sd))
    assert r.returncode == 0, r.stderr
    model, meta = load(w)
    with torch.no_grad():
        assert torch.allclose(run_stages(model, x), trained(x), atol=1e-5)
    assert "sd.pt" in meta["weights"]


def test_bad_arguments(tmp_path):
    r = export("alexnet", tmp_path / "x.pt")
    assert r.returncode != 0 and "alexnet" in r.stderr
    sd = tmp_path / "wrong.pt"
    torch.save({"not.a.key": torch.zeros(1)}, sd)
    r = export("resnet18", tmp_path / "y.pt", "--input-size", "64", "--weights", str(sd))
    assert r.returncode != 0 and "not.a.key" in r.stderr
    assert not (tmp_path / "y.pt").exists()
    r = export("vit_b_16", tmp_path / "z.pt", "--input-size", "40")
    assert r.returncode != 0 and "16" in r.stderr
