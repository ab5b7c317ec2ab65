"""The extractor end to end: hapi-features (C decode, preprocess, libtorch) against torchvision + PIL."""
import json
import subprocess

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from conftest import BUILD_ROOT

HAPI_FEATURES = BUILD_ROOT / "tests" / "hapi-features"

# (arch, input size, splits by name), each split tried in fp32 and fp16.
MODELS = [
    ("resnet18", 64, ["layer2", "pool"]),
    ("vgg16", 64, ["block3", "fc7"]),
    ("vit_b_16", 32, ["head_input"]),
]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A few photo-like JPEGs and PNGs of 100-200 px, odd sizes and both orientations."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(7)
    paths = []
    for i, (h, w, fmt) in enumerate([(120, 160, "jpg"), (187, 131, "jpg"), (100, 100, "png"),
                                     (143, 199, "png"), (161, 117, "jpg")]):
        low = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), np.int16)
        img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
        path = root / f"img{i}.{fmt}"
        Image.fromarray(img).save(path, **({"quality": 90} if fmt == "jpg" else {}))
        paths.append(path)
    return paths


def need_tool():
    if not HAPI_FEATURES.exists():
        pytest.skip(f"{HAPI_FEATURES} is not built (set HAPI_BUILD_ROOT)")


def load_staged(path):
    extra = {"hapifs.json": ""}
    model = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    return model, json.loads(extra["hapifs.json"])


def reference(model, meta, image_paths, split):
    """PIL open -> RGB -> Resize -> CenterCrop -> ToTensor -> Normalize, then stages [0, split).

    The resize filter is the archive's (version 1 has none: bilinear)."""
    mode = T.InterpolationMode(meta.get("interpolation", "bilinear"))
    tf = T.Compose([T.Resize(meta["resize_size"], mode), T.CenterCrop(meta["input_size"]),
                    T.ToTensor(), T.Normalize(meta["mean"], meta["std"])])
    x = torch.stack([tf(Image.open(p).convert("RGB")) for p in image_paths])
    with torch.no_grad():
        for stage in list(model.children())[:split]:
            x = stage(x)
    return x.numpy()


def read_feat(path):
    """Loads a .npy and checks the .feat layout: v1.0, data at a multiple of 64 bytes."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x93NUMPY\x01\x00"
    data_offset = 10 + int.from_bytes(raw[8:10], "little")
    assert data_offset % 64 == 0 and raw[data_offset - 1:data_offset] == b"\n"
    arr = np.load(path)
    assert arr.nbytes == len(raw) - data_offset
    return arr


def run_features(model, outdir, paths, *args):
    outdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(HAPI_FEATURES), str(model), str(outdir), *map(str, paths), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("arch,size,splits", MODELS, ids=[m[0] for m in MODELS])
def test_features_match_torchvision(tmp_path, models, images, arch, size, splits):
    need_tool()
    archive = models(arch, size)
    model, meta = load_staged(archive)
    for split_name in splits:
        split = meta["stages"].index(split_name) + 1
        ref = reference(model, meta, images, split)
        for dtype in ("fp32", "fp16"):
            out = tmp_path / f"{split_name}-{dtype}"
            r = run_features(archive, out, images, "--split", split_name, "--dtype", dtype)
            assert r.returncode == 0, r.stderr
            for i, p in enumerate(images):
                got = read_feat(out / f"{p.name}.npy")
                want = ref[i]
                assert got.dtype == (np.float16 if dtype == "fp16" else np.float32)
                assert got.shape == want.shape, (split_name, got.shape, want.shape)
                g = got.astype(np.float64).ravel()
                w = want.astype(np.float64).ravel()
                cos = g @ w / np.sqrt((g @ g) * (w @ w))
                rel = np.abs(g - w).max() / np.abs(w).max()
                if dtype == "fp32":
                    assert cos >= 0.9999 and rel <= 1e-3, (p.name, split_name, cos, rel)
                    print(f"parity {arch} {split_name} {p.name}: cos {cos:.8f} rel {rel:.3g} "
                          f"abs {np.abs(g - w).max():.3g}")
                else:
                    # fp16 rounding (2^-11 relative) on top of the fp32 differences above
                    tol = np.abs(w) * 2.0 ** -11 + 2.0 ** -24 + 1e-3 * np.abs(w).max()
                    assert np.all(np.abs(g - w) <= tol), (p.name, split_name)
                    assert cos >= 0.9999, (p.name, split_name, cos)


def test_shape_is_split_output(tmp_path, models, images):
    need_tool()
    archive = models("resnet18", 64)
    r = run_features(archive, tmp_path / "o", images[:1], "--split", "3")
    assert r.returncode == 0, r.stderr
    assert read_feat(tmp_path / "o" / f"{images[0].name}.npy").shape == (128, 8, 8)
    r = run_features(archive, tmp_path / "p", images[:1])  # auto: the freeze index, pool
    assert r.returncode == 0, r.stderr
    assert read_feat(tmp_path / "p" / f"{images[0].name}.npy").shape == (512,)


def test_bad_inputs_reported_and_others_written(tmp_path, models, images):
    need_tool()
    archive = models("resnet18", 64)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(images[0].read_bytes()[:300])
    missing = tmp_path / "missing.jpg"
    r = run_features(archive, tmp_path / "o", [broken, images[1], missing], "--dtype", "fp16")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith(f"hapi-features: {broken}: ")
    assert lines[1].startswith(f"hapi-features: {missing}: ")
    assert (tmp_path / "o" / f"{images[1].name}.npy").exists()
    assert not (tmp_path / "o" / "broken.jpg.npy").exists()


def test_bad_split_fails_with_message(tmp_path, models, images):
    need_tool()
    archive = models("resnet18", 64)
    r = run_features(archive, tmp_path / "o", images[:1], "--split", "fc")
    assert r.returncode == 1
    assert "past the frozen stages" in r.stderr and "pool" in r.stderr


def test_bicubic_archive_resizes_bicubic(tmp_path, models, images):
    """An archive that names bicubic gets features of bicubic inputs, not of bilinear ones."""
    need_tool()
    model, meta = load_staged(models("resnet18", 64))
    archive = tmp_path / "bicubic.pt"
    meta = dict(meta, version=2, interpolation="bicubic")
    torch.jit.save(model, str(archive), _extra_files={"hapifs.json": json.dumps(meta)})
    r = run_features(archive, tmp_path / "o", images, "--split", "stem", "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    bicubic = reference(model, meta, images, 1)
    bilinear = reference(model, dict(meta, interpolation="bilinear"), images, 1)
    for i, p in enumerate(images):
        got = read_feat(tmp_path / "o" / f"{p.name}.npy").astype(np.float64)
        to_bicubic = np.abs(got - bicubic[i]).max() / np.abs(bicubic[i]).max()
        to_bilinear = np.abs(got - bilinear[i]).max() / np.abs(bilinear[i]).max()
        print(f"bicubic archive {p.name}: rel {to_bicubic:.3g} to bicubic, "
              f"{to_bilinear:.3g} to bilinear")
        assert to_bicubic <= 1e-3 and to_bilinear > 10 * to_bicubic, (p.name, to_bicubic,
                                                                      to_bilinear)
