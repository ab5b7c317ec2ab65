"""Archives of the wider zoo and of a user's own module served by a real mount, against
torchvision + PIL with the weights' own preprocessing (bicubic for EfficientNet), at several
splits."""
import json
import subprocess

import numpy as np
import pytest

from conftest import EXPORTER, PYTHON, make_image_kinds, reference_features, reference_input

# arch, the splits read (by name)
ZOO = [
    ("efficientnet_b0", ["features_2", "features_8", "pool"]),
    ("convnext_tiny", ["features_3", "pool"]),
    ("regnet_y_400mf", ["trunk_output_block2", "pool"]),
    ("googlenet", ["conv1", "pool"]),
]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo-kinds")
    return root, make_image_kinds(root)


@pytest.mark.parametrize("arch,splits", ZOO, ids=[z[0] for z in ZOO])
def test_mounted_zoo_features(tmp_path, tree, mounter, arch, splits):
    src, made = tree
    archive = tmp_path / f"{arch}.pt"
    subprocess.run([PYTHON, str(EXPORTER), arch, "-o", str(archive), "--input-size", "64", "-q"],
                   check=True, capture_output=True)
    for split in splits:
        m = mounter(src, model=archive, split=split, dtype="fp32", cache=str(tmp_path / split))
        config = m.ctl("config")
        stages = [s["name"] for s in config["model"]["stages"]]
        k = stages.index(split) + 1
        for p in made:
            got = np.load(m.path / (p + ".feat"))
            ref = reference_features(archive, src / p, k)
            assert got.shape == ref.shape, (arch, split, p)
            g, w = got.ravel().astype(np.float64), ref.ravel().astype(np.float64)
            cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
            rel = np.abs(g - w).max() / np.abs(w).max()
            assert cos >= 0.99999 and rel <= 1e-3, (arch, split, p, cos, rel)
        m.unmount()


TINY_MODULE = '''
import torch
from torch import nn


class Tiny(nn.Module):
    """Channel counts that are not multiples of 16 behind Hardswish, ReLU6 and Hardsigmoid:
    libtorch 1.13's oneDNN rewrite of those activations gets such channels wrong."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 24, 3, stride=2, padding=1), nn.BatchNorm2d(24),
                                  nn.Hardswish())
        self.block = nn.Sequential(nn.Conv2d(24, 40, 3, stride=2, padding=1), nn.ReLU6())
        self.gate = nn.Sequential(nn.Conv2d(40, 40, 1), nn.Hardsigmoid())
        self.head = nn.Linear(40, 10)

    def forward(self, x):
        x = self.block(self.stem(x))
        x = x * self.gate(x)
        return self.head(x.mean((2, 3)))


def make():
    return Tiny()
'''


def user_module(tmp_path, name, text, seed):
    """The module make() of text returns, written to tmp_path/NAME.py and imported, its
    weights drawn after torch.manual_seed(seed), in eval mode."""
    import importlib.util
    import torch
    (tmp_path / f"{name}.py").write_text(text)
    spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    return module.make().eval()


def export_module(tmp_path, name, model, stages):
    """hapifs-export-model --module tmp_path/NAME.py:make --stages STAGES at 32 px, with
    model's weights saved to a file: the archive's path and its hapifs.json."""
    import torch
    torch.save(model.state_dict(), tmp_path / f"{name}.pth")
    archive = tmp_path / f"{name}.pt"
    r = subprocess.run([PYTHON, str(EXPORTER), "--module", f"{tmp_path / name}.py:make",
                        "--stages", stages, "--weights", str(tmp_path / f"{name}.pth"),
                        "--input-size", "32", "-o", str(archive), "-q"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    extra = {"hapifs.json": ""}
    torch.jit.load(str(archive), _extra_files=extra)
    return archive, json.loads(extra["hapifs.json"])


def test_a_users_module_is_served_as_its_eager_forward(tmp_path, tree, mounter):
    """A module of the user's (FILE.py:FUNCTION, cut by --stages, its weights from a file)
    served by a real mount in fp32 and bf16: every stage equals the module's own eager
    computation on the image as torchvision + PIL preprocess it."""
    import torch
    src, made = tree
    model = user_module(tmp_path, "tiny", TINY_MODULE, seed=5)
    bn = model.stem[1]
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    archive, meta = export_module(tmp_path, "tiny", model, "stem,block,gated=mul")
    assert meta["arch"] == "module:tiny.py:make"
    assert meta["stages"] == ["stem", "block", "gated", "head"]

    def eager(x):
        with torch.no_grad():
            s = model.stem(x)
            b = model.block(s)
            g = b * model.gate(b)
            return {"stem": s, "block": b, "gated": g, "head": model.head(g.mean((2, 3)))}
    want = {p: {k: v[0].numpy() for k, v in eager(reference_input(meta, src / p)).items()}
            for p in made}
    for precision, bound in (("fp32", 0.99999), ("bf16", 0.999)):
        m = mounter(src, model=archive, split="stem", freeze=4, dtype="fp32",
                    precision=precision, cache=str(tmp_path / precision))
        m.ctl("config")  # the first split is served: ctl takes commands
        for stage in meta["stages"]:
            (m.path / ".hapifs" / "ctl").write_text(f"split {stage}\n")
            for p in made:
                got = np.load(m.path / (p + ".feat"))
                ref = want[p][stage]
                assert got.shape == ref.shape, (precision, stage, p)
                g, w = got.ravel().astype(np.float64), ref.ravel().astype(np.float64)
                cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
                err = np.abs(g - w).max() / np.abs(w).max()
                assert cos >= bound and err <= (1e-4 if precision == "fp32" else 3e-2), \
                    (precision, stage, p, cos, err)
        m.unmount()


FRAGILE_MODULE = '''
from torch import nn


class Offset(nn.Module):
    """An offset put on and taken off: exact in fp32; in bf16, whose step is 2 at 300, the
    activations are lost in the rounding."""

    def forward(self, x):
        return (x + 300.0) - 300.0


class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU())
        self.offset = Offset()
        self.body = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.body(self.offset(self.stem(x)))
        return self.head(x.mean((2, 3)))


def make():
    return Fragile()
'''


def test_a_stage_bf16_cannot_carry_runs_in_fp32(tmp_path, tree, mounter):
    """precision=bf16 on a module with a stage that bf16 cannot compute: the probe's check
    moves that stage to fp32 (and only it), .hapifs/config and the log say so, and every
    split's features stay within cosine 0.999 of the module's own eager fp32 forward."""
    import torch
    src, made = tree
    model = user_module(tmp_path, "fragile", FRAGILE_MODULE, seed=7)
    archive, meta = export_module(tmp_path, "fragile", model, "stem,offset,body")
    assert meta["stages"] == ["stem", "offset", "body", "head"]

    def eager(x):
        with torch.no_grad():
            s = model.stem(x)
            o = model.offset(s)
            b = model.body(o)
            return {"stem": s, "offset": o, "body": b, "head": model.head(b.mean((2, 3)))}
    want = {p: {k: v[0].numpy() for k, v in eager(reference_input(meta, src / p)).items()}
            for p in made}
    m = mounter(src, model=archive, split="stem", freeze=4, dtype="fp32", precision="bf16",
                cache=str(tmp_path / "cache"))
    stages = {s["name"]: s for s in m.ctl("config")["model"]["stages"]}
    assert {k: s["precision"] for k, s in stages.items()} == \
        {"stem": "bf16", "offset": "fp32", "body": "bf16", "head": "bf16"}, stages
    assert all(0.9995 <= s["check_cosine"] <= 1.0 + 1e-9 for s in stages.values()), stages
    assert "precision=bf16: stages offset run in fp32" in m.log_text()
    for stage in meta["stages"]:
        (m.path / ".hapifs" / "ctl").write_text(f"split {stage}\n")
        for p in made:
            got = np.load(m.path / (p + ".feat"))
            g, w = got.ravel().astype(np.float64), want[p][stage].ravel().astype(np.float64)
            cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
            assert cos >= 0.999, (stage, p, cos)
    m.unmount()
