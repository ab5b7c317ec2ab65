"""hapifs-export-model: the staged archive format, its metadata, the zoo's cuts, weights,
preprocessing and a user's own module."""
import json
import subprocess

import pytest
import torch
import torchvision

from conftest import EXPORTER, PYTHON

RESNET = ["stem", "layer1", "layer2", "layer3", "layer4", "pool", "fc"]
CASES = [
    # arch, input size, stage names (None: the exporter's choice), resize/crop of the weights
    ("resnet18", 64, RESNET, 256 / 224),
    # VGG's cuts (blocks at each max pooling, fc6..fc8) on its cheapest kin: vgg16 takes 45 s
    ("alexnet", 64, ["block1", "block2", "block3", "pool", "fc6", "fc7", "fc8"], 256 / 224),
    ("vit_b_16", 32, ["embed"] + [f"block{i}" for i in range(12)] + ["head_input", "heads"],
     256 / 224),
    ("efficientnet_b0", 64, None, 256 / 224),
    ("convnext_tiny", 64, None, 236 / 224),
    ("regnet_y_400mf", 64, None, 232 / 224),
    ("mobilenet_v3_small", 64, None, 256 / 224),
    ("swin_t", 64, None, 232 / 224),
    ("densenet121", 32, None, 256 / 224),
]
BICUBIC = {"efficientnet_b0", "swin_t"}


def export(arch, out, *args):
    cmd = [PYTHON, str(EXPORTER), *([arch] if arch else []), "-o", str(out), "-q", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


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


def reference_model(arch, size, seed, **kwargs):
    """torchvision's model with the random weights the exporter draws for seed."""
    if arch.startswith("vit"):
        kwargs["image_size"] = size
    if arch in ("googlenet", "inception_v3"):
        kwargs.update(transform_input=True, aux_logits=True, init_weights=True)
    torch.manual_seed(seed)
    return torchvision.models.get_model(arch, weights=None, **kwargs).eval()


@pytest.mark.parametrize("arch,size,names,ratio", CASES, ids=[c[0] for c in CASES])
def test_staged_archive_equals_torchvision(tmp_path, arch, size, names, ratio):
    out = tmp_path / f"{arch}.pt"
    r = export(arch, out, "--input-size", str(size), "--seed", "3", "--num-classes", "10")
    assert r.returncode == 0, r.stderr
    assert "warning: random weights" in r.stderr
    model, meta = load(out)
    children = [n for n, _ in model.named_children()]
    assert meta["format"] == "hapifs-staged" and meta["version"] == 2 and meta["arch"] == arch
    assert meta["stages"] == children
    if names:
        assert children == names
    else:
        assert 5 <= len(children) <= 9, children
    # the default freeze is the classifier head: what enters it is the pooled feature vector
    assert meta["freeze"] == len(children) - 1
    assert meta["input_size"] == size and meta["resize_size"] == round(size * ratio)
    assert meta["interpolation"] == ("bicubic" if arch in BICUBIC else "bilinear")
    assert meta["mean"] == pytest.approx([0.485, 0.456, 0.406])
    assert meta["std"] == pytest.approx([0.229, 0.224, 0.225])
    assert meta["weights"] == "random:seed=3" and meta["weights_enum"] is None
    assert meta["num_classes"] == 10
    # the stages in order compute what torchvision's model computes, at another batch size
    ref_model = reference_model(arch, size, 3, num_classes=10)
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(x)
    got = run_stages(model, x)
    assert got.shape == ref.shape == (3, 10)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    pooled = run_stages(model, x, meta["freeze"])
    assert pooled.dim() == 2 and pooled.shape[0] == 3
    # a stage never overwrites its input, the feature its predecessor served
    with torch.no_grad():
        for name, stage in model.named_children():
            before = x.clone()
            y = stage(x)
            assert torch.equal(x, before), name
            x = y


def test_transform_input_is_in_the_first_stage(tmp_path):
    """GoogLeNet as torchvision builds it for its weights renormalises inside forward."""
    out = tmp_path / "g.pt"
    r = export("googlenet", out, "--input-size", "64", "--seed", "2", "--num-classes", "10")
    assert r.returncode == 0, r.stderr
    model, meta = load(out)
    assert meta["stages"][-2:] == ["pool", "fc"] and meta["freeze"] == len(meta["stages"]) - 1
    ref = reference_model("googlenet", 64, 2, num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(run_stages(model, x), ref(x), atol=1e-6)
        # random GoogLeNet weights make the logits nearly constant: compare the first stage
        first = run_stages(model, x, 1)
        assert meta["stages"][0] == "conv1"
        assert torch.allclose(first, ref.conv1(ref._transform_input(x)), atol=1e-6)
        assert not torch.allclose(first, ref.conv1(x), atol=1e-2)


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
    assert "random" not in r.stderr
    model, meta = load(w)
    with torch.no_grad():
        assert torch.allclose(run_stages(model, x), trained(x), atol=1e-5)
    assert meta["weights"] == "file:sd.pt"


@pytest.mark.parametrize("wrap", ["module", "lightning", "pickled"])
def test_checkpoint_forms_accepted(tmp_path, wrap):
    """DataParallel's module. prefix, a Lightning checkpoint's state_dict of model.<key>, a
    whole module: the same weights."""
    torch.manual_seed(12)
    trained = torchvision.models.mobilenet_v3_small(weights=None, num_classes=7).eval()
    sd = trained.state_dict()
    if wrap == "module":
        saved = {f"module.{k}": v for k, v in sd.items()}
    elif wrap == "lightning":
        saved = {"epoch": 3, "state_dict": {f"model.{k}": v for k, v in sd.items()}}
    else:
        saved = trained
    path = tmp_path / "ckpt.pt"
    torch.save(saved, path)
    out = tmp_path / "m.pt"
    r = export("mobilenet_v3_small", out, "--input-size", "64", "--num-classes", "7",
               "--weights", str(path))
    assert r.returncode == 0, r.stderr
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(run_stages(load(out)[0], x), trained(x), atol=1e-5)


def test_googlenet_checkpoint_without_aux_classifiers(tmp_path):
    torch.manual_seed(13)
    trained = torchvision.models.googlenet(weights=None, aux_logits=False, transform_input=True,
                                           init_weights=True, num_classes=5).eval()
    path = tmp_path / "g.pt"
    torch.save(trained.state_dict(), path)
    out = tmp_path / "out.pt"
    r = export("googlenet", out, "--input-size", "64", "--num-classes", "5", "--weights", str(path))
    assert r.returncode == 0, r.stderr
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(run_stages(load(out)[0], x), trained(x), atol=1e-5)


def test_weights_enum_gives_preprocessing(tmp_path):
    out = tmp_path / "m.pt"
    r = export("mobilenet_v2", out, "--weights-enum", "MobileNet_V2_Weights.IMAGENET1K_V1")
    assert r.returncode == 0, r.stderr
    meta = load(out)[1]
    assert (meta["input_size"], meta["resize_size"], meta["interpolation"]) == \
        (224, 256, "bilinear")
    assert meta["weights_enum"] == "MobileNet_V2_Weights.IMAGENET1K_V1"
    # without an enum: the architecture's DEFAULT weights (V2: resize 232)
    r = export("mobilenet_v2", out, "--input-size", "112")
    assert r.returncode == 0, r.stderr
    meta = load(out)[1]
    assert (meta["input_size"], meta["resize_size"]) == (112, 116)
    assert meta["weights_enum"] is None
    # an enum by its member name alone, and every option overriding it
    r = export("efficientnet_b0", out, "--weights-enum", "IMAGENET1K_V1", "--input-size", "48",
               "--resize-size", "60", "--interpolation", "bilinear", "--mean", "0.5,0.5,0.5",
               "--std", "0.25,0.25,0.25")
    assert r.returncode == 0, r.stderr
    meta = load(out)[1]
    assert (meta["input_size"], meta["resize_size"], meta["interpolation"]) == \
        (48, 60, "bilinear")
    assert meta["mean"] == [0.5] * 3 and meta["std"] == [0.25] * 3
    assert meta["weights_enum"] == "EfficientNet_B0_Weights.IMAGENET1K_V1"


USER_MODULE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.body = nn.Sequential(Block(8), nn.Conv2d(8, 16, 3, stride=2, padding=1), Block(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def build():
    torch.manual_seed(0)
    return Net().eval()
'''


def test_user_module(tmp_path):
    src = tmp_path / "mynet.py"
    src.write_text(USER_MODULE)
    out = tmp_path / "u.pt"
    spec = f"{src}:build"
    r = export(None, out, "--module", spec, "--input-size", "32",
               "--stages", "stem,block1=body.0,body,pool=mean")
    assert r.returncode == 0, r.stderr
    model, meta = load(out)
    assert meta["stages"] == ["stem", "block1", "body", "pool", "head"]
    assert meta["freeze"] == 4 and meta["arch"] == "module:mynet.py:build"
    assert (meta["resize_size"], meta["interpolation"]) == (37, "bilinear")
    import importlib.util
    s = importlib.util.spec_from_file_location("mynet", src)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    net = mod.build()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(run_stages(model, x), net(x), atol=1e-6)
        assert run_stages(model, x, 3).shape == (3, 16, 8, 8)
    # inside the residual block two tensors are live: refused, saying which
    r = export(None, tmp_path / "v.pt", "--module", spec, "--input-size", "32",
               "--stages", "stem,body.0.conv")
    assert r.returncode != 0 and not (tmp_path / "v.pt").exists()
    assert "body.0.conv" in r.stderr and "2 values cross it" in r.stderr, r.stderr
    r = export(None, tmp_path / "v.pt", "--module", spec, "--stages", "nothere")
    assert r.returncode != 0 and "nothere" in r.stderr and "stem" in r.stderr, r.stderr
    r = export(None, tmp_path / "v.pt", "--module", spec)
    assert r.returncode != 0 and "--stages" in r.stderr
    r = subprocess.run([PYTHON, str(EXPORTER), "--module", spec, "--input-size", "32",
                        "--list-cuts"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cuts = [line.split()[0] for line in r.stdout.splitlines()]
    assert "body.0.relu" in cuts and "body.0.conv" not in cuts and "stem.1" in cuts


def test_bad_arguments(tmp_path):
    r = export("resnet9000", tmp_path / "x.pt")
    assert r.returncode != 0 and "resnet9000" in r.stderr
    assert "efficientnet_b0" in r.stderr and "swin_t" in r.stderr
    # a state_dict of another architecture: the mismatched keys by name
    torch.save(torchvision.models.resnet34(weights=None).state_dict(), tmp_path / "r34.pt")
    r = export("resnet18", tmp_path / "y.pt", "--input-size", "64",
               "--weights", str(tmp_path / "r34.pt"))
    assert r.returncode != 0 and "unexpected keys: layer1.2." in r.stderr, r.stderr
    assert not (tmp_path / "y.pt").exists()
    torch.save(torchvision.models.resnet18(weights=None, num_classes=10).state_dict(),
               tmp_path / "r18.pt")
    r = export("resnet18", tmp_path / "y.pt", "--input-size", "64",
               "--weights", str(tmp_path / "r18.pt"))
    assert r.returncode != 0 and "fc.weight [10, 512]" in r.stderr, r.stderr
    assert "--num-classes" in r.stderr
    r = export("vit_b_16", tmp_path / "z.pt", "--input-size", "40")
    assert r.returncode != 0 and "16" in r.stderr
    r = export("resnet18", tmp_path / "z.pt", "--weights-enum", "ResNet50_Weights.IMAGENET1K_V2")
    assert r.returncode != 0 and "ResNet18_Weights.IMAGENET1K_V1" in r.stderr, r.stderr
    r = export("resnet18", tmp_path / "z.pt", "--input-size", "64", "--stages", "layer1.0.conv2")
    assert r.returncode != 0 and "cannot cut after 'layer1.0.conv2'" in r.stderr, r.stderr


def test_man_page_lists_every_option():
    """hapifs-export-model(1) and --help name the same options."""
    r = subprocess.run([PYTHON, str(EXPORTER), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0
    import re
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", r.stdout)) - {"--help"}
    page = (EXPORTER.parent / "hapifs-export-model.1.scd").read_text()
    documented = set(re.findall(r"\*(--[a-z][a-z-]+)\*", page))
    assert options == documented
    assert len(options) >= 15


def test_vit_weights_of_another_size(tmp_path):
    torch.save(torchvision.models.vit_b_32(weights=None, image_size=64).state_dict(),
               tmp_path / "vit64.pt")
    r = export("vit_b_32", tmp_path / "v.pt", "--input-size", "32",
               "--weights", str(tmp_path / "vit64.pt"))
    assert r.returncode != 0, r.stderr
    assert "encoder.pos_embedding [1, 5, 768] in the file, [1, 2, 768] in the model" in r.stderr
    assert "--input-size" in r.stderr
