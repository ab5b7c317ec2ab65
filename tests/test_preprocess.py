#!/usr/bin/python3
# test_preprocess.py — parity of hapi-dump's preprocessing with PIL + torchvision, on images made here.
#
# Run: HAPI_BUILD_ROOT=build /usr/bin/python3 -m pytest -q tests/test_preprocess.py
# Set HAPI_PARITY_REPORT=FILE to get every measured max abs diff / cosine as JSON lines.
import json
import os
import struct
import subprocess
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transforms = pytest.importorskip("torchvision.transforms")
from PIL import Image  # noqa: E402

BUILD_ROOT = os.environ.get("HAPI_BUILD_ROOT", "/work/main/build")
HAPI_DUMP = os.path.join(BUILD_ROOT, "tests", "hapi-dump")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
PAIRS = [(73, 64), (128, 112), (256, 224), (48, 64), (30, 64)]
# The filters an archive may name; torchvision hands each to PIL's resize.
INTERPOLATIONS = ["bilinear", "bicubic"]

pytestmark = pytest.mark.skipif(not os.access(HAPI_DUMP, os.X_OK),
                                reason=f"{HAPI_DUMP} not built (set HAPI_BUILD_ROOT)")


def report(**fields):
    path = os.environ.get("HAPI_PARITY_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


# ------------------------------------------------------------ image makers

def photo(w, h, seed=1):
    """Smooth gradients, noise and a few hard edges: JPEG-friendly, resampling-hostile."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([128 + 100 * np.sin(x / 37.0 + y / 53.0),
                    128 + 100 * np.cos(x / 23.0 - y / 41.0),
                    255 * (x + y) / (w + h)], -1)
    img += rng.normal(0, 12, (h, w, 3))
    img[h // 4:h // 2, w // 3:w // 2] = (240, 30, 30)
    img[h // 2:, : w // 5] = (10, 200, 60)
    return np.clip(img, 0, 255).astype(np.uint8)


def _chunk(kind, data):
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def raw_png(w, h, depth, color_type, rows, extra=b""):
    """A PNG from packed row bytes (filter 0), for layouts Pillow cannot write."""
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 0)
    data = b"".join(b"\0" + r for r in rows)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + extra
            + _chunk(b"IDAT", zlib.compress(data)) + _chunk(b"IEND", b""))


def pack_bits(values, depth):
    """Packs one row of small integers MSB first, as PNG does for 1/2/4-bit samples."""
    per = 8 // depth
    out = bytearray()
    for i in range(0, len(values), per):
        byte = 0
        for j, v in enumerate(values[i:i + per]):
            byte |= int(v) << (8 - depth * (j + 1))
        out.append(byte)
    return bytes(out)


def interlaced_png(arr, depth, color_type):
    """An Adam7-interlaced PNG (Pillow cannot write one): every pass's rows, filter 0."""
    h, w = arr.shape[:2]
    data = b""
    for xs, ys, dx, dy in ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4),
                           (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)):
        sub = arr[ys::dy, xs::dx]
        if sub.shape[0] == 0 or sub.shape[1] == 0:
            continue
        for row in sub:
            data += b"\0" + (pack_bits(row, depth) if depth < 8 else row.tobytes())
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 1)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", zlib.compress(data)) + _chunk(b"IEND", b""))


def ycck_jpeg(cmyk):
    """TurboJPEG turns CMYK input into a YCCK JPEG; Pillow cannot write YCCK itself."""
    import ctypes
    tj = ctypes.CDLL("libturbojpeg.so.0")
    tj.tjInitCompress.restype = ctypes.c_void_p
    handle = ctypes.c_void_p(tj.tjInitCompress())
    buf = ctypes.POINTER(ctypes.c_ubyte)()
    size = ctypes.c_ulong(0)
    h, w = cmyk.shape[:2]
    cmyk = np.ascontiguousarray(cmyk)
    TJPF_CMYK, TJSAMP_420 = 11, 2
    rc = tj.tjCompress2(handle, cmyk.ctypes.data_as(ctypes.c_void_p), w, 0, h, TJPF_CMYK,
                        ctypes.byref(buf), ctypes.byref(size), TJSAMP_420, 90, 0)
    assert rc == 0
    data = ctypes.string_at(buf, size.value)
    tj.tjFree(buf)
    tj.tjDestroy(handle)
    return data


def save(im, path, **kw):
    im.save(path, **kw)
    return path


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


def make_images(d):
    """Every kind of image the decoder claims to handle: {name: path}."""
    p = lambda n: os.path.join(d, n)  # noqa: E731
    rgb = Image.fromarray(photo(97, 61))
    big = Image.fromarray(photo(640, 480, seed=2))
    imgs = {}
    for sub, tag in ((0, "444"), (1, "422"), (2, "420")):
        imgs[f"jpeg_{tag}"] = save(rgb, p(f"j{tag}.jpg"), quality=90, subsampling=sub)
    imgs["jpeg_420_tall"] = save(Image.fromarray(photo(61, 97)), p("tall.jpg"), quality=85)
    imgs["jpeg_420_wide"] = save(Image.fromarray(photo(300, 17)), p("wide.jpg"), quality=85)
    imgs["jpeg_progressive"] = save(big, p("prog.jpg"), quality=80, progressive=True)
    imgs["jpeg_photo_640"] = save(big, p("photo.jpg"), quality=85)
    imgs["jpeg_gray"] = save(rgb.convert("L"), p("gray.jpg"), quality=90)
    imgs["jpeg_cmyk"] = save(rgb.convert("CMYK"), p("cmyk.jpg"), quality=90)
    cmyk = np.concatenate([photo(97, 61, seed=5), photo(97, 61, seed=6)[:, :, :1]], -1)
    imgs["jpeg_ycck"] = write(p("ycck.jpg"), ycck_jpeg(cmyk))
    # libjpeg warnings that PIL ignores: junk before the EOI marker, bytes after it.
    with open(imgs["jpeg_420"], "rb") as f:
        data = f.read()
    imgs["jpeg_extraneous"] = write(p("extra.jpg"), data[:-2] + b"\x00\x11\x22" + data[-2:])
    imgs["jpeg_trailing"] = write(p("trail.jpg"), data + b"garbage" * 3)
    imgs["jpeg_small"] = save(Image.fromarray(photo(40, 30)), p("small.jpg"), quality=90)

    imgs["png_rgb"] = save(rgb, p("rgb.png"))
    imgs["png_rgb_wide"] = save(Image.fromarray(photo(300, 17)), p("wide.png"))
    imgs["png_rgb_small"] = save(Image.fromarray(photo(40, 30)), p("small.png"))
    alpha = Image.fromarray(np.tile(np.arange(97, dtype=np.uint8) * 2, (61, 1)))
    rgba = rgb.copy()
    rgba.putalpha(alpha)
    imgs["png_rgba"] = save(rgba, p("rgba.png"))
    la = rgb.convert("L")
    la.putalpha(alpha)
    imgs["png_la"] = save(la, p("la.png"))
    imgs["png_l"] = save(rgb.convert("L"), p("l.png"))
    pal = rgb.quantize(64)
    imgs["png_p"] = save(pal, p("p.png"))
    imgs["png_p_trns"] = save(pal, p("ptrns.png"), transparency=bytes(range(0, 256, 8)))
    imgs["png_p4"] = save(rgb.quantize(16), p("p4.png"), bits=4)
    imgs["png_1bit"] = save(rgb.convert("1"), p("one.png"))
    # 16-bit gray: values around 255 so that Pillow's clipping to 0..255 shows.
    g16 = (np.asarray(rgb.convert("L"), dtype=np.uint16) * 2).astype(np.uint16)
    g16[0, :10] = [0, 1, 254, 255, 256, 257, 1000, 30000, 65534, 65535]
    imgs["png_gray16"] = save(Image.fromarray(g16), p("g16.png"))
    # 16-bit RGB/RGBA: Pillow cannot write them; build them by hand.
    a16 = photo(97, 61, seed=3).astype(np.uint16) * 257 + np.random.default_rng(4).integers(
        0, 257, (61, 97, 3)).astype(np.uint16)
    imgs["png_rgb16"] = write(p("rgb16.png"), raw_png(
        97, 61, 16, 2, [a16[y].astype(">u2").tobytes() for y in range(61)]))
    a16a = np.concatenate([a16, np.full((61, 97, 1), 12345, np.uint16)], -1)
    imgs["png_rgba16"] = write(p("rgba16.png"), raw_png(
        97, 61, 16, 6, [a16a[y].astype(">u2").tobytes() for y in range(61)]))
    imgs["png_rgb_interlaced"] = write(p("adam7.png"), interlaced_png(photo(97, 61), 8, 2))
    # Sub-byte gray and palette depths.
    gray = np.asarray(rgb.convert("L"))
    for depth in (2, 4):
        vals = gray >> (8 - depth)
        imgs[f"png_gray{depth}"] = write(p(f"g{depth}.png"), raw_png(
            97, 61, depth, 0, [pack_bits(vals[y], depth) for y in range(61)]))
    imgs["png_gray2_interlaced"] = write(p("g2i.png"), interlaced_png(gray >> 6, 2, 0))
    idx = gray >> 6  # 2-bit indices; PLTE with 3 entries so index 3 falls back to gray
    plte = _chunk(b"PLTE", bytes([200, 10, 10, 10, 200, 10, 10, 10, 200]))
    imgs["png_p2_short_plte"] = write(p("p2.png"), raw_png(
        97, 61, 2, 3, [pack_bits(idx[y], 2) for y in range(61)], plte))
    return imgs


# ------------------------------------------------------------- references

def reference(path, resize, crop, interpolation="bilinear"):
    t = transforms.Compose([
        transforms.Resize(resize, transforms.InterpolationMode(interpolation)),
        transforms.CenterCrop(crop),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    with Image.open(path) as im:
        return t(im.convert("RGB")).numpy()


def dump(path, out, *args):
    return subprocess.run([HAPI_DUMP, "preprocess", path, out, *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def ours(tmp_path, path, resize, crop, *extra):
    out = str(tmp_path / "out.npy")
    r = dump(path, out, "--resize", resize, "--crop", crop,
             "--mean", ",".join(map(str, MEAN)), "--std", ",".join(map(str, STD)), *extra)
    assert r.returncode == 0, r.stderr
    a = np.load(out)
    assert a.dtype == np.float32 and a.shape == (3, crop, crop)
    with open(out, "rb") as f:
        head = f.read(10)
    assert head[:8] == b"\x93NUMPY\x01\x00"
    assert (10 + struct.unpack("<H", head[8:10])[0]) % 64 == 0
    return a


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(str(tmp_path_factory.mktemp("images")))


KINDS = ["jpeg_444", "jpeg_422", "jpeg_420", "jpeg_420_tall", "jpeg_420_wide",
         "jpeg_progressive", "jpeg_photo_640", "jpeg_gray", "jpeg_cmyk", "jpeg_ycck", "jpeg_small",
         "jpeg_extraneous", "jpeg_trailing",
         "png_rgb", "png_rgb_wide", "png_rgb_small", "png_rgba", "png_la", "png_l", "png_p",
         "png_p_trns", "png_p4", "png_1bit", "png_gray16", "png_rgb16", "png_rgba16",
         "png_gray2", "png_gray4", "png_p2_short_plte", "png_rgb_interlaced",
         "png_gray2_interlaced"]


# ------------------------------------------------------------------ tests

@pytest.mark.filterwarnings("ignore:Palette images with Transparency")
@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("resize,crop", PAIRS)
@pytest.mark.parametrize("kind", KINDS)
def test_exact_parity(images, tmp_path, kind, resize, crop, interpolation):
    ref = reference(images[kind], resize, crop, interpolation)
    got = ours(tmp_path, images[kind], resize, crop, "--interpolation", interpolation)
    diff = float(np.abs(got - ref).max())
    rel = float((np.abs(got - ref) / np.maximum(np.abs(ref), 1e-6)).max())
    report(test="exact", kind=kind, resize=resize, crop=crop, interpolation=interpolation,
           max_abs_diff=diff, cosine=cosine(got, ref))
    assert cosine(got, ref) >= 0.9999 and rel <= 1e-3, f"max abs diff {diff}"
    assert diff == 0.0, (f"{kind} {resize}/{crop} {interpolation}: not bit-exact, "
                         f"max abs diff {diff}")


def test_bicubic_is_not_bilinear(images, tmp_path):
    """The flag reaches the resampler: the two filters give other pixels of one photo."""
    bilinear = ours(tmp_path, images["jpeg_photo_640"], 128, 112)
    bicubic = ours(tmp_path, images["jpeg_photo_640"], 128, 112, "--interpolation", "bicubic")
    assert np.abs(bilinear - bicubic).max() > 0.1


def test_unchanged_size_is_not_resampled(tmp_path):
    """Short side already equal to resize: torchvision returns the image untouched."""
    path = str(tmp_path / "same.png")
    Image.fromarray(photo(64, 90)).save(path)
    got = ours(tmp_path, path, 64, 56)
    assert np.array_equal(got, reference(path, 64, 56))


def test_padding_is_normalised_zero(tmp_path):
    """A crop larger than the image: the border is (0 - mean) / std, the inside the image."""
    path = str(tmp_path / "tiny.png")
    Image.new("RGB", (20, 10), (255, 255, 255)).save(path)
    got = ours(tmp_path, path, 10, 16)
    for c in range(3):
        pad = (np.float32(0.0) - np.float32(MEAN[c])) / np.float32(STD[c])
        white = (np.float32(1.0) - np.float32(MEAN[c])) / np.float32(STD[c])
        assert got[c, 0, 0] == pad and got[c, 15, 15] == pad
        assert got[c, 3, 0] == white  # rows 3..12 hold the image, columns 0..15 inside it
        assert np.all(got[c, :3] == pad) and np.all(got[c, 13:] == pad)
    assert np.array_equal(got, reference(path, 10, 16))


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("size", [(640, 480), (1024, 768), (500, 375), (481, 1031)])
@pytest.mark.parametrize("resize,crop", [(256, 224), (128, 112), (73, 64)])
def test_fast_mode_close(tmp_path, size, resize, crop, interpolation):
    path = str(tmp_path / "fast.jpg")
    Image.fromarray(photo(*size, seed=size[0])).save(path, quality=85)
    ref = reference(path, resize, crop, interpolation)
    got = ours(tmp_path, path, resize, crop, "--fast", "--interpolation", interpolation)
    cos = cosine(got, ref)
    report(test="fast", size=list(size), resize=resize, crop=crop, interpolation=interpolation,
           cosine=cos, max_abs_diff=float(np.abs(got - ref).max()))
    assert cos >= 0.995, f"fast-mode cosine {cos}"


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_fast_mode_png_is_exact(images, tmp_path, interpolation):
    got = ours(tmp_path, images["png_rgb"], 73, 64, "--fast", "--interpolation", interpolation)
    assert np.array_equal(got, reference(images["png_rgb"], 73, 64, interpolation))


# ----------------------------------------------------------------- errors

def expect_failure(path, tmp_path, *extra):
    r = dump(path, str(tmp_path / "never.npy"), *extra)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hapi-dump: {path}: "), r.stderr
    assert not os.path.exists(tmp_path / "never.npy")
    return lines[0]


def test_truncated_jpeg_fails_like_pil(images, tmp_path):
    with open(images["jpeg_photo_640"], "rb") as f:
        data = f.read()
    path = write(str(tmp_path / "trunc.jpg"), data[: len(data) // 2])
    with pytest.raises(OSError):
        with Image.open(path) as im:
            im.convert("RGB")
    msg = expect_failure(path, tmp_path)
    assert "Premature end" in msg


def test_jpeg_without_eoi_fails_like_pil(images, tmp_path):
    with open(images["jpeg_420"], "rb") as f:
        data = f.read()
    path = write(str(tmp_path / "noeoi.jpg"), data[:-2])
    with pytest.raises(OSError):
        with Image.open(path) as im:
            im.convert("RGB")
    assert "Premature end" in expect_failure(path, tmp_path)


def test_truncated_png_fails(images, tmp_path):
    with open(images["png_rgb"], "rb") as f:
        data = f.read()
    path = write(str(tmp_path / "trunc.png"), data[: len(data) // 2])
    assert "PNG" in expect_failure(path, tmp_path)


def test_garbage_fails(tmp_path):
    path = write(str(tmp_path / "junk.jpg"), bytes(range(256)) * 4)
    assert "neither JPEG nor PNG" in expect_failure(path, tmp_path)


def test_corrupt_jpeg_body_fails(tmp_path):
    path = write(str(tmp_path / "bad.jpg"), b"\xff\xd8\xff\xe0" + b"\x00" * 100)
    assert "JPEG" in expect_failure(path, tmp_path)


def test_pixel_limit(images, tmp_path):
    msg = expect_failure(images["jpeg_photo_640"], tmp_path, "--max-pixels", 640 * 480 - 1)
    assert "limit" in msg
    ours(tmp_path, images["jpeg_photo_640"], 73, 64, "--max-pixels", 640 * 480)


def test_missing_file(tmp_path):
    expect_failure(str(tmp_path / "absent.jpg"), tmp_path)


def test_unknown_interpolation_is_a_usage_error(images, tmp_path):
    r = dump(images["png_rgb"], str(tmp_path / "never.npy"), "--interpolation", "lanczos")
    assert r.returncode == 2 and "bad option --interpolation lanczos" in r.stderr
    assert not os.path.exists(tmp_path / "never.npy")
