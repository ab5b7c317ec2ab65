"""Shared fixtures of the Python tests: where the build is, staged models, image trees, real mounts."""
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

SOURCE_ROOT = Path(os.environ.get("HAPI_SOURCE_ROOT", Path(__file__).resolve().parent.parent))
BUILD_ROOT = Path(os.environ.get("HAPI_BUILD_ROOT", SOURCE_ROOT / "build"))
HAPIFS = BUILD_ROOT / "fusefs" / "hapifs"
EXPORTER = SOURCE_ROOT / "tools" / "hapifs-export-model"
PYTHON = "/usr/bin/python3"
# What the tests share with the scripts of bench/ (load_tool loads one as a module).
sys.path.insert(0, str(SOURCE_ROOT / "bench"))
from hapitools import ctl_json, daemon_pid, is_mounted, load_tool  # noqa: E402,F401


SANITIZER_LOGS = os.environ.get("HAPI_SANITIZER_LOGS")


def sanitized_elsewhere():
    """(files, tests left out) of tests/sanitize-quick: what the sanitizer lane runs."""
    files, left_out = set(), set()
    for line in (SOURCE_ROOT / "tests" / "sanitize-quick").read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "-":
            left_out.add(words[1])
        else:
            files.add(words[0])
    return files, left_out


def pytest_collection_modifyitems(config, items):
    """HAPI_SANITIZED_ELSEWHERE=1 (tools/run-tests, beside the sanitizer lane): the tests that
    lane runs are deselected here, so that each runs once, against the stricter daemon."""
    if os.environ.get("HAPI_SANITIZED_ELSEWHERE") != "1":
        return
    files, left_out = sanitized_elsewhere()
    keep, drop = [], []
    for item in items:
        path = os.path.relpath(str(item.fspath), SOURCE_ROOT)  # as the file names it
        test = path + "::" + item.nodeid.split("::", 1)[1]
        (drop if path in files and test not in left_out else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def sanitizer_reports():
    """Under tools/sanitize: a report written while a test ran (its daemon's, at the latest
    when the test unmounts) fails that test. Reports are moved to seen/ once attributed."""
    if not SANITIZER_LOGS:
        yield
        return
    logs = Path(SANITIZER_LOGS)
    yield
    new = sorted(p for p in logs.iterdir() if p.is_file())
    if new:
        (logs / "seen").mkdir(exist_ok=True)
        texts = []
        for p in new:
            # the other pytest worker may have taken it first: then the report is its test's
            try:
                text = p.read_text(errors="replace")[:3000]
                p.rename(logs / "seen" / p.name)
            except OSError:
                continue
            texts.append(f"--- {p.name}\n" + text)
        if texts:
            pytest.fail("sanitizer reports:\n" + "\n".join(texts), pytrace=False)


def need_hapifs():
    if not HAPIFS.exists():
        pytest.skip(f"{HAPIFS} is not built (set HAPI_BUILD_ROOT)")
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("mount tests need /dev/fuse and root")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """export(arch, size) -> path of a staged archive, exported once per session."""
    cache = {}
    root = tmp_path_factory.mktemp("models")

    def export(arch="resnet18", size=64, seed=0):
        key = (arch, size, seed)
        if key not in cache:
            out = root / f"{arch}-{size}-{seed}.pt"
            subprocess.run([PYTHON, str(EXPORTER), arch, "-o", str(out), "--input-size",
                            str(size), "--seed", str(seed)], check=True,
                           stdout=subprocess.DEVNULL)
            cache[key] = out
        return cache[key]

    return export


def _smooth(h, w, rng):
    """A photo-like image: smooth gradients, a few blobs, a little noise."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        a, b, p = rng.uniform(-1, 1, 3)
        img[..., c] = 128 + 90 * np.sin(a * x / 17 + b * y / 23 + p)
    for _ in range(3):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(5, max(6, min(h, w) / 3))
        mask = (y - cy) ** 2 + (x - cx) ** 2 < r * r
        img[mask] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def write_png16(path, arr16):
    """A 16-bit RGB PNG written by hand (Pillow cannot write 16-bit RGB)."""
    import struct
    import zlib
    h, w, _ = arr16.shape
    raw = b"".join(b"\x00" + arr16[r].astype(">u2").tobytes() for r in range(h))

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)


def make_image_kinds(root, seed=0):
    """Writes one image of every kind hapifs must read; returns {relative path: kind}."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    root = Path(root)
    made = {}

    def save(rel, img, **kw):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        img.save(p, **kw)
        made[rel] = rel

    rgb = lambda h, w: Image.fromarray(_smooth(h, w, rng))  # noqa: E731
    save("jpeg/baseline444.jpg", rgb(120, 160), quality=90, subsampling=0)
    save("jpeg/baseline422.jpg", rgb(97, 131), quality=85, subsampling=1)
    save("jpeg/baseline420.jpg", rgb(150, 113), quality=80, subsampling=2)
    save("jpeg/progressive.jpg", rgb(128, 171), quality=88, progressive=True)
    save("jpeg/gray.jpg", rgb(100, 140).convert("L"), quality=90)
    save("jpeg/cmyk.jpg", rgb(90, 120).convert("CMYK"), quality=92)
    save("jpeg/small.jpg", rgb(40, 30), quality=90)
    save("jpeg/wide.JPEG", rgb(17, 300), quality=90)
    save("png/rgb.png", rgb(99, 77))
    save("png/rgba.png", Image.fromarray(np.dstack([_smooth(80, 96, rng),
                                                    rng.integers(0, 256, (80, 96), np.uint8)])))
    save("png/la.png", rgb(70, 90).convert("LA"))
    save("png/gray.png", rgb(66, 88).convert("L"))
    save("png/palette.png", rgb(72, 100).convert("P", palette=Image.ADAPTIVE, colors=64))
    pt = rgb(72, 100).convert("P", palette=Image.ADAPTIVE, colors=32)
    pt.info["transparency"] = 3
    save("png/palette_trns.png", pt, transparency=3)
    save("png/gray16.png", Image.fromarray((rng.integers(0, 65536, (64, 80))).astype(np.uint16)))
    save("png/bilevel.png", rgb(61, 83).convert("1"))
    p16 = root / "png/rgb16.png"
    write_png16(p16, rng.integers(0, 65536, (70, 90, 3)).astype(np.uint16))
    made["png/rgb16.png"] = "png/rgb16.png"
    return made


def reference_input(meta, image_path):
    """The image as torchvision + PIL preprocess it with an archive's metadata: (1, 3, H, W)."""
    import torchvision.transforms as T
    from PIL import Image
    interpolation = T.InterpolationMode(meta.get("interpolation", "bilinear"))
    tf = T.Compose([T.Resize(meta["resize_size"], interpolation),
                    T.CenterCrop(meta["input_size"]), T.ToTensor(),
                    T.Normalize(meta["mean"], meta["std"])])
    return tf(Image.open(image_path).convert("RGB")).unsqueeze(0)


_loaded = {}  # (path, inode, size, mtime) -> (module, meta): the last few archives loaded


def loaded_archive(archive):
    """The archive's TorchScript module and its hapifs.json, loaded once while the file is
    unchanged (a load, and the first runs of a freshly loaded module, cost more than the
    reference's runs themselves)."""
    import torch
    st = os.stat(archive)
    key = (str(archive), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _loaded:
        extra = {"hapifs.json": ""}
        model = torch.jit.load(str(archive), map_location="cpu", _extra_files=extra)
        while len(_loaded) >= 4:
            _loaded.pop(next(iter(_loaded)))
        _loaded[key] = (model, json.loads(extra["hapifs.json"]))
    return _loaded[key]


def reference_features(archive, image_path, split, meta=None):
    """torchvision + PIL preprocessing, then the staged model's stages [0, split), in fp32."""
    import torch
    model, meta_of_archive = loaded_archive(archive)
    x = reference_input(meta_of_archive, image_path)
    with torch.no_grad():
        for i, (_, stage) in enumerate(model.named_children()):
            if i >= split:
                break
            x = stage(x)
    return x[0].numpy()


class Mount:
    """A real hapifs mount, started as a daemon like mount(8) would, torn down cleanly."""

    def __init__(self, source, mountpoint, options, binary=HAPIFS):
        self.source = Path(source)
        self.path = Path(mountpoint)
        self.path.mkdir(parents=True, exist_ok=True)
        self.options = options
        self.log = self.path.parent / (self.path.name + ".log")
        opts = ",".join(k if v is None else f"{k}={v}" for k, v in options.items())
        cmd = [str(binary), str(source), str(mountpoint), "-o", f"{opts},log={self.log}"]
        self.proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if self.proc.returncode != 0:
            raise RuntimeError(f"mount failed: {self.proc.stderr.strip()}")
        self.pid = self.daemon_pid()

    def daemon_pid(self):
        return daemon_pid(self.path)

    def ctl(self, name):
        return ctl_json(self.path, name)

    def unmount(self):
        if is_mounted(self.path):
            subprocess.run(["fusermount3", "-u", str(self.path)], check=False)
        wait_gone(self.pid)

    def log_text(self):
        return self.log.read_text() if self.log.exists() else ""


def abort_connection(mountpoint):
    """Aborts the FUSE connection of mountpoint (a daemon that no longer answers): its waiting
    requests fail with ECONNABORTED. Found by /proc/self/mountinfo, not stat(2), which would
    wait for the daemon too. Returns whether a connection was aborted."""
    want = os.path.realpath(mountpoint)
    with open("/proc/self/mountinfo") as f:
        devs = [line.split()[2] for line in f if line.split()[4] == want]
    if not devs:
        return False
    conns = Path("/sys/fs/fuse/connections")
    if not any(conns.iterdir()):
        subprocess.run(["mount", "-t", "fusectl", "none", str(conns)], check=False)
    (conns / devs[-1].split(":")[1] / "abort").write_text("1")
    return True


def wait_gone(pid, timeout=20):
    if not pid:
        return True
    end = time.time() + timeout
    while time.time() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie whose parent has not reaped it yet has exited too
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="session")
def profiles(tmp_path_factory):
    """Where the mounts of a test run keep the profiles they measured, to share them.

    Every mount profiles its model unless its cache holds the profile (2.5 s for a ResNet-18
    at 64 px here, about twice that under the sanitizers, before the first read is served).
    The suite's tests are not about that, bar the ones that say so (own_profile=True)."""
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture
def mounter(tmp_path, profiles):
    """mount(source, **options) -> Mount; every mount is unmounted at the end of the test.

    A cache directory that does not exist yet (the test's own by default) is made with the
    profiles earlier tests measured in it, unless own_profile=True: a test of profiling."""
    need_hapifs()
    mounts = []
    caches = []  # the cache directories whose profiles are worth sharing

    def mount(source, mountpoint=None, own_profile=False, **options):
        options.setdefault("cache", str(tmp_path / "cache"))
        cache = Path(options["cache"])
        fresh = not cache.exists()
        cache.mkdir(parents=True, exist_ok=True)
        if fresh and not own_profile:
            for p in profiles.glob("profile-*.json"):
                shutil.copy(p, cache / p.name)
        if "mem" not in options and "profile" not in options:  # nor a profile capped by mem=
            caches.append(cache)
        mp = mountpoint or tmp_path / f"mnt{len(mounts)}"
        m = Mount(source, mp, options)
        mounts.append(m)
        return m

    yield mount
    for m in reversed(mounts):  # the last first: a remote mount holds the storage mount open
        m.unmount()
    for cache in caches:
        for p in cache.glob("profile-*.json"):
            if not (profiles / p.name).exists():
                shutil.copy(p, profiles / p.name)
    for m in mounts:
        assert not is_mounted(m.path), f"{m.path} still mounted"
        assert wait_gone(m.pid), f"daemon {m.pid} still running"


def npy_bytes(arr):
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()
