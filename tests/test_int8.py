"""precision=int8 on a real mount: calibrated on the first images of the mount's own source
(seeded samples where it has none), each stage kept in int8 only while the features stay within
cosine 0.995 of fp32's there, in a cache namespace named by the calibration's samples."""
import re

import numpy as np

from test_export_mount import export_module, user_module
from test_throughput import make_tree, wait_for

CALIBRATION_IMAGES, MIN_COSINE = 32, 0.995  # extractor.h, HAPI_INT8_*


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def test_int8_is_calibrated_on_the_source_and_stays_near_fp32(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=2, per_class=20, size=(64, 80))
    model = models("resnet18", 64)
    f = mounter(src, model=model, split="pool", dtype="fp32", cache=str(tmp_path / "f"))
    want = {p: np.load(f.path / (p + ".feat")) for p in paths}
    fp32_ns = f.ctl("config")["cache"]["namespace"]
    f.unmount()

    m = mounter(src, model=model, split="pool", dtype="fp32", precision="int8",
                cache=str(tmp_path / "q"))
    config = m.ctl("config")
    stages = {s["name"]: s for s in config["model"]["stages"]}
    assert config["model"]["precision"] == "int8"
    # every stage with convolutions or a linear layer in int8; pooling has nothing to quantize
    assert {k: s["precision"] for k, s in stages.items()} == {
        "stem": "int8", "layer1": "int8", "layer2": "int8", "layer3": "int8", "layer4": "int8",
        "pool": "fp32", "fc": "int8"}, stages
    assert all(MIN_COSINE <= s["check_cosine"] <= 1 + 1e-9 for s in stages.values()), stages
    cal = config["model"]["int8_calibration"]
    assert cal["images"] == CALIBRATION_IMAGES and cal["samples"] == "source", cal
    assert len(cal["digest"]) == 32 and cal["seconds"] > 0 and cal["min_cosine"] == 0.995, cal
    assert f"precision=int8: calibrated on the first {CALIBRATION_IMAGES} images of " \
        f"{src}" in m.log_text()
    ns = config["cache"]["namespace"]
    assert ns != fp32_ns
    got = {}
    for p in paths:
        got[p] = np.load(m.path / (p + ".feat"))
        assert got[p].shape == want[p].shape and got[p].dtype == np.float32, p
        # the bound is met on the calibration's own images; 0.99 on the others
        assert cosine(got[p], want[p]) >= 0.99, (p, cosine(got[p], want[p]))
    # int8 is timed as int8: a profile of its own, not fp32's (which the cache holds)
    assert wait_for(lambda: re.search(r"(stored in|profile read from) \S+/profile-[0-9a-f]{32}-"
                                      r"cpu-int8-", m.log_text()))
    m.unmount()

    # the same source calibrates the same: the next mount finds its features in the cache
    again = mounter(src, model=model, split="pool", dtype="fp32", precision="int8",
                    cache=str(tmp_path / "q"))
    assert again.ctl("config")["cache"]["namespace"] == ns
    for p in paths[:5]:
        assert np.array_equal(np.load(again.path / (p + ".feat")), got[p]), p
    assert again.ctl("stats")["feat"]["computed"] == 0


def test_int8_without_images_is_calibrated_on_seeded_samples(tmp_path, models, mounter):
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text("not an image\n")
    m = mounter(src, model=models("resnet18", 64), split="layer2", precision="int8")
    cal = m.ctl("config")["model"]["int8_calibration"]
    assert cal["images"] == 0 and cal["samples"] == "seeded", cal
    assert f"precision=int8: calibrated on {CALIBRATION_IMAGES} seeded image-like samples " \
        f"(no image in {src})" in m.log_text()


FRAGILE_MODULE = '''
from torch import nn


class Offset(nn.Module):
    """An offset put on and taken off between two convolutions: exact in fp32; in int8 the
    sum is quantized at a step of about 1.2, larger than the activations themselves."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(16, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        return self.b((self.a(x) + 300.0) - 300.0)


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


def test_a_stage_int8_cannot_carry_runs_in_fp32(tmp_path, mounter):
    """A stage whose int8 features fall below the bound runs in fp32, and only it; every
    split stays within cosine 0.99 of the module's own eager fp32 forward."""
    import torch
    from conftest import reference_input
    src = tmp_path / "src"
    paths = make_tree(src, classes=1, per_class=6, size=(40, 48))
    model = user_module(tmp_path, "fragile8", FRAGILE_MODULE, seed=3)
    archive, meta = export_module(tmp_path, "fragile8", model, "stem,offset,body")

    def eager(x):
        with torch.no_grad():
            s = model.stem(x)
            o = model.offset(s)
            b = model.body(o)
            return {"stem": s, "offset": o, "body": b, "head": model.head(b.mean((2, 3)))}
    want = {p: {k: v[0].numpy() for k, v in eager(reference_input(meta, src / p)).items()}
            for p in paths}
    m = mounter(src, model=archive, split="stem", freeze=4, dtype="fp32", precision="int8")
    stages = {s["name"]: s for s in m.ctl("config")["model"]["stages"]}
    assert {k: s["precision"] for k, s in stages.items()} == \
        {"stem": "int8", "offset": "fp32", "body": "int8", "head": "int8"}, stages
    assert all(MIN_COSINE <= s["check_cosine"] <= 1 + 1e-9 for s in stages.values()), stages
    assert "int8: stem, body, head; fp32: offset" in m.log_text()
    for stage in meta["stages"]:
        (m.path / ".hapifs" / "ctl").write_text(f"split {stage}\n")
        for p in paths:
            got = np.load(m.path / (p + ".feat"))
            assert cosine(got, want[p][stage]) >= 0.99, (stage, p)


SMALL_CHANNEL_MODULE = '''
import torch
from torch import nn


class Pick(nn.Module):
    def forward(self, x):
        return x[:, :1]


class SmallChannel(nn.Module):
    """The body's first channel is a thousand times smaller than the others, and the next
    stage keeps only it: the body's int8 features are close to fp32's as a whole, but that
    channel is lost in the rounding of the others' scale (as a ViT's class token can be)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU())
        self.body = nn.Conv2d(16, 32, 3, padding=1)
        with torch.no_grad():
            self.body.weight[0] *= 1e-3
            self.body.bias[0] *= 1e-3
        self.pick = Pick()
        self.head = nn.Linear(1, 10)

    def forward(self, x):
        return self.head(self.pick(self.body(self.stem(x))).mean((2, 3)))


def make():
    return SmallChannel()
'''


def test_a_later_stage_that_magnifies_int8_rounding_moves_the_one_before(tmp_path, mounter):
    """A stage with nothing to quantize whose features fall below the bound moves the last
    int8 stage before it to fp32; the model's features then stay within the bound."""
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=6, size=(40, 48))
    model = user_module(tmp_path, "small8", SMALL_CHANNEL_MODULE, seed=4)
    archive, meta = export_module(tmp_path, "small8", model, "stem,body,pick")
    m = mounter(src, model=archive, split="pick", freeze=4, dtype="fp32", precision="int8")
    stages = {s["name"]: s for s in m.ctl("config")["model"]["stages"]}
    assert {k: s["precision"] for k, s in stages.items()} == \
        {"stem": "int8", "body": "fp32", "pick": "fp32", "head": "int8"}, \
        [(k, s["precision"], s["check_cosine"]) for k, s in stages.items()]
    assert all(MIN_COSINE <= s["check_cosine"] <= 1 + 1e-9 for s in stages.values()), stages
