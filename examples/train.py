#!/usr/bin/python3
"""Train a classifier on precomputed features, e.g. on a hapifs mount.

    train.py ROOT [--epochs 5] [--batch-size 32] [--lr 1e-3] [--workers 2]
                  [--seed 0] [--val-fraction 0.2]
                  [--model auto|none|PATH] [--split N|NAME] [--report FILE]
                  [--threads N] [--trunk-first]

ROOT holds one folder per class with one .feat file (a NumPy .npy array) per
sample, which is what hapifs shows over an image dataset: ROOT/<class>/x.jpg.feat
holds the output of the first stages [0, split) of a staged model archive (made
by hapifs-export-model) for ROOT/<class>/x.jpg. The classifier trained here is
a small head; the network's own stages are never trained.

The trunk. A mount may cut the network before its last frozen stage (to move
fewer bytes or spare the storage node): then the frozen stages [split, freeze)
still have to run here, between the features and the head. train.py finds the
mount's control file .hapifs/config in ROOT or a parent folder (reachable by
name, not listed; it crosses sshfs), whose split.stages_after = [split, freeze]
names those stages, and runs them as a frozen trunk: eval mode, no gradients,
torch.inference_mode, in the main process on whole batches (the DataLoader
workers only read files). Where the stages come from is --model:
  auto  (default) nothing if the split is at the freeze point; otherwise the
        mount's .hapifs/model (the archive itself, served by the mount), else
        the config's model.path if that file exists on this machine, else an
        error asking for --model PATH.
  PATH  that archive (a copy of the mount's model).
  none  no trunk: train the head on the features as they are.
The archive is checked against the mount before training: the same stage names
(and architecture), the same XXH3-128 digest when it can be computed here (with
Python's xxhash module, or through ctypes with libxxhash, the library the daemon
uses), and the trunk must turn a zero tensor of the feature shape into the shape
the config gives for stage freeze-1. Each stage is then frozen and fused for
inference (torch.jit.freeze, optimize_for_inference) where that gives the same
output. Without a hapifs config (plain .npy files), there is no trunk unless
--model PATH is given with --split N|NAME, the split the features were made at
(NAME: through that stage, as the mount option); the trunk then runs
[split, the archive's freeze index). A mount still choosing its split is waited
for; if its split changes during training (hapifs-ctl split, its policy), the
features no longer fit the trunk and head, and train.py stops with a message.
The first feature is read before the trunk is set up (its shape checks the
trunk), so the storage node computes features while the archive is read and
the trunk optimized; --trunk-first sets the trunk up first, from the split's
shape in the config, and reads no feature before (benchmarks comparing splits
by their epochs: no split then starts its first epoch ahead).

Features stored as float16 are converted to float32 before the trunk and head.
This process runs the trunk and the head with --threads torch threads (default:
the CPUs it may use less one per DataLoader worker).
The output is one line per epoch, a line with the trunk's cost per sample in
the first epoch, and the final validation accuracy against chance; --report
FILE also writes these figures as JSON (rewritten after every epoch).

Nothing here depends on hapifs at run time beyond reading .hapifs/config and
.hapifs/model; it is a plain PyTorch script.
"""

import argparse
import ctypes
import ctypes.util
import io
import json
import os
import sys
import time


def make_parser():
    """The command line (needs only the standard library, so --help always works)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="When the features stop before the model's freeze point (a hapifs mount "
               "with an early split), the frozen stages [split, freeze) run here, between "
               "the features and the head: see the top of this file.")
    p.add_argument("root", help="folder with one subfolder of .feat files per class")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--model", default="auto", metavar="auto|none|PATH",
                   help="where the frozen stages [split, freeze) come from when the features "
                        "stop before them: auto (default) = the mount's .hapifs/model, else "
                        "its model path if present here; none = no trunk; PATH = that staged "
                        "archive (checked against the mount)")
    p.add_argument("--split", metavar="N|NAME",
                   help="without a hapifs mount (plain .npy files), with --model PATH: the "
                        "features are the output of stages [0, N) (NAME: through stage NAME)")
    p.add_argument("--report", metavar="FILE",
                   help="also write per-epoch wall time, samples/s, accuracies and the final "
                        "val_acc to FILE as JSON")
    p.add_argument("--trunk-first", action="store_true",
                   help="on a hapifs mount, set up the trunk (read the model archive, freeze "
                        "and optimize it, for the split's shape in .hapifs/config) before "
                        "reading any feature. By default the first feature is read first, so "
                        "the storage node starts computing features while the trunk is set "
                        "up; benchmarks comparing splits by their epochs use this so that no "
                        "split starts its first epoch ahead")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch threads of this process, which runs the trunk and the head "
                        "(default: the CPUs it may use less one per worker, at least 1)")
    return p


try:
    import numpy as np
    import torch
    import torchvision
    from torch import nn
    from torch.utils.data import DataLoader, random_split
except ImportError as e:
    if __name__ != "__main__":
        raise
    make_parser().parse_args()  # --help and usage errors need no torch
    sys.exit(f"train.py: {sys.executable} has no {e.name}; run it with a Python that has "
             f"torch, numpy and torchvision (e.g. /usr/bin/python3 {sys.argv[0]})")


class TrunkError(Exception):
    """The frozen stages cannot be set up (missing or mismatched archive, bad split)."""


def to_float_tensor(array):
    """Features may be stored as fp16; the model computes in fp32."""
    return torch.from_numpy(array.astype(np.float32, copy=False))


def make_head(in_features, num_classes, hidden=256, dropout=0.2):
    """Classifier on top of the features, whatever their shape.

    Features of a frozen network (especially one that has not been trained on
    this data) have wildly different scales per channel, so the head first
    standardizes every input (BatchNorm without affine parameters), then runs
    a small MLP.
    """
    return nn.Sequential(
        nn.Flatten(),
        nn.BatchNorm1d(in_features, affine=False),
        nn.Dropout(dropout),
        nn.Linear(in_features, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, num_classes),
    )


# ---------------------------------------------------------------------------
# The frozen trunk: stages [start, stop) of a staged archive


class StageTrunk(nn.Module):
    """Frozen stages [start, stop) of a staged archive, run in order.

    Always in eval mode, without gradients, under torch.inference_mode; the
    output is cloned into an ordinary tensor so the head can train on it. With
    no stages it returns its input unchanged. Keeps the time spent in every
    stage, so that the cost per sample can be reported.
    """

    def __init__(self, stages=(), start=0, source=None, arch=None):
        super().__init__()
        self.start = start
        self.stop = start + len(stages)
        self.names = [name for name, _ in stages]
        self.stages = nn.ModuleList([module for _, module in stages])
        self.source = source
        self.arch = arch
        self.checked = []    # what build_trunk verified against the mount
        self.optimized = []  # the stages StageTrunk.optimize replaced
        self.ctl, self.split = None, {}  # the mount's control directory and split, if any
        self.requires_grad_(False)
        self.eval()
        self.reset_timing()

    def train(self, mode=True):
        return super().train(False)  # frozen: batch norm keeps its running statistics

    def reset_timing(self):
        self.seconds = [0.0] * len(self.stages)
        self.copy_seconds = 0.0
        self.samples = 0

    def forward(self, x):
        if not len(self.stages):
            return x
        with torch.inference_mode():
            for i, stage in enumerate(self.stages):
                t = time.perf_counter()
                x = stage(x)
                self.seconds[i] += time.perf_counter() - t
        self.samples += x.shape[0]
        t = time.perf_counter()
        x = x.clone()  # inference tensors cannot be saved for backward
        self.copy_seconds += time.perf_counter() - t
        return x

    def optimize(self, feature_shape):
        """Freezes and fuses every stage for inference (torch.jit.freeze, then
        optimize_for_inference: batch norm folded into convolutions, fused
        activations), keeping the stage as it is wherever that fails or does not
        give the same output on a random input of the stage's shape."""
        x = torch.randn(2, *feature_shape, generator=torch.Generator().manual_seed(0))
        for i, (name, stage) in enumerate(zip(self.names, self.stages)):
            with torch.inference_mode():
                y = stage(x)
            try:
                fast = torch.jit.optimize_for_inference(torch.jit.freeze(stage.eval()))
                with torch.inference_mode():
                    for _ in range(2):  # the profiling executor specializes on the 2nd run
                        yf = fast(x)
                same = yf.shape == y.shape and torch.allclose(
                    yf, y, rtol=1e-4, atol=1e-5 * max(y.abs().max().item(), 1.0))
            except Exception:  # a stage TorchScript cannot freeze stays as it is
                same = False
            if same:
                self.stages[i] = fast
                self.optimized.append(name)
            x = y

    def describe(self):
        if not len(self.stages):
            return "none"
        where = f" of {self.arch}" if self.arch else ""
        src = f" from {self.source}" if self.source else ""
        checked = f", checked: {', '.join(self.checked)}" if self.checked else ""
        return (f"stages [{self.start}, {self.stop}) ({', '.join(self.names)}){where}{src}"
                f"{checked}")

    def cost(self):
        """(ms per sample of the whole trunk, {stage: ms per sample}) since reset_timing."""
        n = max(self.samples, 1)
        per = {name: 1e3 * s / n for name, s in zip(self.names, self.seconds)}
        return sum(per.values()) + 1e3 * self.copy_seconds / n, per


def read_archive(path):
    """(scripted staged module, its hapifs.json metadata or {}, the file's bytes)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TrunkError(f"{path}: cannot read the model archive: {e.strerror or e}")
    extra = {"hapifs.json": ""}
    try:
        module = torch.jit.load(io.BytesIO(data), map_location="cpu", _extra_files=extra)
    except Exception as e:  # torch raises RuntimeError and others for a foreign file
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise TrunkError(f"{path}: not a TorchScript archive: {first}")
    try:
        meta = json.loads(extra["hapifs.json"]) if extra["hapifs.json"] else {}
    except ValueError:
        meta = {}
    return module.eval(), meta, data


class _XXH128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def xxh3_128_hex(data):
    """The daemon's model digest: XXH3-128 of the bytes, canonical (big-endian) hex.

    From the Python module xxhash if installed, else from libxxhash (the library
    the daemon uses) through ctypes; None if neither is there.
    """
    try:
        import xxhash
        return xxhash.xxh3_128(data).hexdigest()
    except ImportError:
        pass
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
        fn = lib.XXH3_128bits
    except (OSError, AttributeError):
        return None
    fn.restype = _XXH128
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    h = fn(data, len(data))
    return f"{h.high64:016x}{h.low64:016x}"


def build_trunk(archive, start, stop, config=None, feature_shape=None, optimize=True,
                loaded=None):
    """The frozen stages [start, stop) of a staged archive (a path), as a StageTrunk.

    With config (a mount's .hapifs/config as a dict) the archive is checked
    against the mount: same stage names and architecture, same digest when it
    can be computed here, and stage stop-1's output shape from a zero input of
    the split's feature shape. feature_shape (one sample's) defaults to the
    config's split.shape; without either the zero-input check is skipped.
    With optimize and a known shape, the stages are frozen and fused for
    inference where that gives the same results (StageTrunk.optimize).
    loaded: read_archive(archive) if the caller has it already.
    Raises TrunkError with a message for the user.
    """
    module, meta, data = loaded or read_archive(archive)
    children = list(module.named_children())
    names = [name for name, _ in children]
    if meta.get("stages") and list(meta["stages"]) != names:
        raise TrunkError(f"{archive}: its hapifs.json lists stages {meta['stages']} "
                         f"but it holds {names}")
    expect_out = None
    checked = []
    if config is not None:
        cm = config.get("model", {})
        mount_names = [s["name"] for s in cm.get("stages", [])]
        if mount_names and mount_names != names:
            raise TrunkError(f"{archive} is not the mount's model: its stages are "
                             f"{', '.join(names)}; the mount's ({cm.get('path')}) are "
                             f"{', '.join(mount_names)}")
        checked.append("stage names")
        if meta.get("arch") and cm.get("arch") and meta["arch"] != cm["arch"]:
            raise TrunkError(f"{archive} is not the mount's model: {meta['arch']}, "
                             f"the mount runs {cm['arch']}")
        digest = xxh3_128_hex(data) if cm.get("digest") else None
        if digest is not None and digest != cm["digest"]:
            raise TrunkError(f"{archive} is not the mount's model: XXH3-128 {digest}, "
                             f"the mount's is {cm['digest']} (other weights?)")
        if digest is not None:
            checked.append("digest")
        if feature_shape is None:
            feature_shape = config.get("split", {}).get("shape")
        stages = cm.get("stages", [])
        if 0 < stop <= len(stages) and "shape" in stages[stop - 1]:
            expect_out = tuple(stages[stop - 1]["shape"])
    if not 0 <= start <= stop <= len(children):
        raise TrunkError(f"{archive}: no stages [{start}, {stop}) in its {len(children)} "
                         f"({', '.join(names)})")
    trunk = StageTrunk(children[start:stop], start, source=str(archive), arch=meta.get("arch"))
    if feature_shape is not None and stop > start:
        try:
            out = trunk(torch.zeros(1, *feature_shape))
        except Exception as e:  # a shape mismatch surfaces as a TorchScript RuntimeError
            msg = str(e).strip().splitlines()
            raise TrunkError(f"{archive}: stages [{start}, {stop}) do not take features of "
                             f"shape {tuple(feature_shape)}: {msg[-1] if msg else e}")
        if expect_out is not None and tuple(out.shape[1:]) != expect_out:
            raise TrunkError(f"{archive}: stages [{start}, {stop}) give shape "
                             f"{tuple(out.shape[1:])}, the mount's model {expect_out}")
        checked.append("shapes")
        if optimize:
            trunk.optimize(feature_shape)
        trunk.reset_timing()
    trunk.checked = checked
    return trunk


def find_mount_config(root):
    """(control directory, parsed config) of the hapifs mount ROOT is in, or (None, None).

    .hapifs is at the mount's top, so ROOT itself and then its parents are tried.
    """
    d = os.path.abspath(root)
    while True:
        ctl = os.path.join(d, ".hapifs")
        path = os.path.join(ctl, "config")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    return ctl, json.load(f)
            except (OSError, ValueError) as e:
                raise TrunkError(f"{path}: cannot read the mount's config: {e}")
        parent = os.path.dirname(d)
        if parent == d:
            return None, None
        d = parent


def read_config(ctl):
    with open(os.path.join(ctl, "config")) as f:
        return json.load(f)


def settled_config(ctl, config, timeout=600.0, log=print):
    """The config once the mount has a split: right after mounting, its policy may still
    be choosing one (split.state "choosing"); reads of .feat files wait for it too."""
    end, said = time.monotonic() + timeout, False
    while "index" not in config.get("split", {}):
        if time.monotonic() > end:
            raise TrunkError(f"{ctl}/config: the mount has chosen no split in {timeout:.0f} s")
        if not said:
            log("waiting for the mount to choose its split ...")
            said = True
        time.sleep(0.2)
        try:
            config = read_config(ctl)
        except (OSError, ValueError):
            pass
    return config


def split_changed(trunk):
    """A message if the mount's split is no longer the one the trunk was built for.

    The split of a mount may change while it is mounted (hapifs-ctl, its policy): the
    features then have another shape and the trunk and head no longer fit them.
    """
    if trunk.ctl is None:
        return None
    try:
        now = read_config(trunk.ctl).get("split", {})
    except (OSError, ValueError):
        return None
    if now.get("index") == trunk.split.get("index"):
        return None
    by = f" (by the {now['by']})" if now.get("by") else ""
    return (f"the mount's split changed from {trunk.split.get('index')} "
            f"({trunk.split.get('stage')}) to {now.get('index')} ({now.get('stage')}){by} "
            f"during training: the features no longer fit this model; run train.py again")


def check_shape(root, feature_shape, split):
    """Raises TrunkError if features of feature_shape are not what the mount's split
    (its .hapifs/config "split") gives."""
    if feature_shape is not None and split.get("shape") is not None \
            and tuple(feature_shape) != tuple(split["shape"]):
        raise TrunkError(f"features of shape {tuple(feature_shape)} under {root}, but the "
                         f"mount's split gives {tuple(split['shape'])}")


def split_index(split, names):
    """--split N (stages [0, N) were run) or NAME (through stage NAME) as an index."""
    split = str(split)
    if split.isdigit():
        return int(split)
    if split in names:
        return names.index(split) + 1
    raise TrunkError(f"--split {split}: no such stage (stages: {', '.join(names)})")


def resolve_trunk(root, model="auto", split=None, feature_shape=None, log=print):
    """The trunk train.py runs between ROOT's features and the head, per --model/--split."""
    ctl, config = find_mount_config(root)
    if config is not None:
        config = settled_config(ctl, config, log=log)
    trunk = _resolve(root, ctl, config, model, split, feature_shape, log)
    trunk.ctl = ctl
    trunk.split = config.get("split", {}) if config else {}
    return trunk


def _resolve(root, ctl, config, model, split, feature_shape, log):
    if config is None:
        if model in ("auto", "none"):
            if split is not None and model == "auto":
                raise TrunkError(f"{root} is not on a hapifs mount (no .hapifs/config): "
                                 f"--split needs --model PATH, the archive the features "
                                 f"were made with")
            return StageTrunk()
        if split is None:
            raise TrunkError(f"{root} is not on a hapifs mount (no .hapifs/config): with "
                             f"--model PATH, give --split N|NAME, the split the features "
                             f"were made at")
        loaded = read_archive(model)
        meta = loaded[1]
        if "freeze" not in meta or "stages" not in meta:
            raise TrunkError(f"{model}: no hapifs.json with the stages and freeze index; "
                             f"export it with hapifs-export-model")
        start, stop = split_index(split, meta["stages"]), int(meta["freeze"])
        if start > stop:
            raise TrunkError(f"--split {split} is past the archive's freeze index {stop}")
        return build_trunk(model, start, stop, feature_shape=feature_shape, loaded=loaded)

    sp = config.get("split", {})
    index, freeze = sp.get("index"), sp.get("freeze")
    start, stop = sp.get("stages_after", [index, freeze])
    if freeze is not None and stop != freeze:  # a daemon from before stages_after = [split, freeze]
        log(f"note: the mount's stages_after {[start, stop]} does not end at its freeze "
            f"index {freeze}; running [{start}, {freeze})")
        stop = freeze
    if split is not None:
        names = [s["name"] for s in config.get("model", {}).get("stages", [])]
        if split_index(split, names) != index:
            raise TrunkError(f"--split {split} differs from the mount's split {index} "
                             f"({sp.get('stage')}); leave it out on a hapifs mount")
    check_shape(root, feature_shape, sp)
    if start >= stop or model == "none":
        if start < stop:
            log(f"note: --model none: training on stage {sp.get('stage')}'s output, without "
                f"the frozen stages [{start}, {stop})")
        return StageTrunk()
    if model == "auto":
        served = os.path.join(ctl, "model")
        path = config.get("model", {}).get("path")
        if os.path.isfile(served):
            model = served
        elif path and os.path.isfile(path):
            model = path
        else:
            names = [s["name"] for s in config.get("model", {}).get("stages", [])][start:stop]
            raise TrunkError(
                f"the features end at stage {sp.get('stage')} (split {index}), so the frozen "
                f"stages [{start}, {stop}) ({', '.join(names)}) must run here, but the mount "
                f"serves no {served} and its model {path} is not on this machine: copy the "
                f"archive here and pass --model PATH (or --model none to train on the "
                f"features as they are)")
    return build_trunk(model, start, stop, config=config, feature_shape=feature_shape)


# ---------------------------------------------------------------------------
# Training


def run_epoch(head, trunk, loader, optimizer=None):
    """One pass over loader; trains the head if an optimizer is given.

    Returns (loss, accuracy, n, seconds waiting for the loader).
    """
    head.train(optimizer is not None)
    total_loss, correct, n, wait = 0.0, 0, 0, 0.0
    it = iter(loader)
    while True:
        t = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t
        x = trunk(x.float())
        with torch.set_grad_enabled(optimizer is not None):
            out = head(x)
            loss = nn.functional.cross_entropy(out, y)
            if optimizer is not None:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        total_loss += loss.item() * len(y)
        correct += (out.argmax(1) == y).sum().item()
        n += len(y)
    return total_loss / max(n, 1), correct / max(n, 1), n, wait


def write_report(path, report):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def keep_heap(keep_bytes=1 << 30):
    """Keeps the memory of freed tensors in this process for the next batch, as the daemon
    does (hapi_extractor_keep_heap): glibc maps every block above its mmap threshold (at most
    32 MiB) on its own and unmaps it when freed, so a trunk's activations were faulted in page
    by page at every batch; VGG-16's first stage at 64 px, batch 16, took 7.9-10.6 ms a sample
    so against 1.7-2.0 with the heap kept. Every block then comes from the heap, whose top
    goes back to the kernel beyond keep_bytes free. Does nothing where libc has no mallopt
    (not glibc). Returns whether both settings took."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    return (mallopt(M_MMAP_MAX, 0) == 1 and
            mallopt(M_TRIM_THRESHOLD, min(keep_bytes, 2**31 - 1)) == 1)


def main(argv=None):
    args = make_parser().parse_args(argv)
    keep_heap()
    torch.manual_seed(args.seed)
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads if args.threads > 0 else max(1, cpus - args.workers))

    ds = torchvision.datasets.DatasetFolder(args.root, loader=np.load, extensions=(".feat",),
                                            transform=to_float_tensor)
    n_val = int(round(len(ds) * args.val_fraction))
    train_ds, val_ds = random_split(ds, [len(ds) - n_val, n_val],
                                    generator=torch.Generator().manual_seed(args.seed))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, drop_last=len(train_ds) > args.batch_size)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)
    # Features are the output of the frozen part of a network, up to the split;
    # the frozen stages after it, if any, run here as the trunk.
    trunk = None
    if args.trunk_first:
        try:  # the split's shape from the mount's config; the first feature checks it below
            if find_mount_config(args.root)[1] is not None:
                trunk = resolve_trunk(args.root, args.model, args.split)
        except TrunkError as e:
            sys.exit(f"train.py: {e}")
    raw = np.load(ds.samples[0][0])
    sample = to_float_tensor(raw)
    print(f"{len(ds)} samples in {len(ds.classes)} classes ({', '.join(ds.classes)}), "
          f"{len(train_ds)} train / {len(val_ds)} val, feature shape {tuple(sample.shape)} "
          f"{raw.dtype}")
    try:
        if trunk is None:
            trunk = resolve_trunk(args.root, args.model, args.split, tuple(sample.shape))
        else:
            check_shape(args.root, tuple(sample.shape), trunk.split)
    except TrunkError as e:
        sys.exit(f"train.py: {e}")
    print(f"trunk: {trunk.describe()}", flush=True)
    with torch.no_grad():
        in_features = trunk(sample[None]).flatten(1).shape[1]
    trunk.reset_timing()
    head = make_head(in_features, len(ds.classes))
    optimizer = torch.optim.Adam(head.parameters(), lr=args.lr)

    report = {
        "root": os.path.abspath(args.root),
        "samples": len(ds), "classes": ds.classes, "train": len(train_ds), "val": len(val_ds),
        "feature_shape": list(sample.shape), "feature_dtype": str(raw.dtype),
        "batch_size": args.batch_size, "workers": args.workers,
        "trunk": {"stages": [trunk.start, trunk.stop] if len(trunk.names) else [],
                  "names": trunk.names, "source": trunk.source, "checked": trunk.checked,
                  "optimized": trunk.optimized, "threads": torch.get_num_threads(),
                  "ms_per_sample": 0.0, "ms_per_sample_by_stage": {}},
        "epochs": [], "final_val_acc": None, "chance": None,
    }
    if args.report:
        try:  # a report that cannot be written fails now, not after the first epoch
            write_report(args.report, report)
        except OSError as e:
            sys.exit(f"train.py: --report {args.report}: {e.strerror or e}")
    val_acc = float("nan")
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        try:
            loss, train_acc, n, wait = run_epoch(head, trunk, train_loader, optimizer)
            t_train = time.time() - t0
            if len(val_ds):
                _, val_acc, _, _ = run_epoch(head, trunk, val_loader)
        except RuntimeError:  # e.g. features of two shapes in a batch
            changed = split_changed(trunk)
            if changed:
                sys.exit(f"train.py: {changed}")
            raise
        wall = time.time() - t0
        changed = split_changed(trunk)
        if changed:
            sys.exit(f"train.py: {changed}")
        print(f"epoch {epoch}/{args.epochs}  loss {loss:.4f}  train_acc {train_acc:.3f}  "
              f"val_acc {val_acc:.3f}  samples/s {n / t_train:.0f}  "
              f"time {wall:.1f} s", flush=True)
        ms, per_stage = trunk.cost()
        if epoch == 1 and len(trunk.names):
            print(f"trunk: {ms:.3f} ms/sample over {trunk.samples} samples in epoch 1 "
                  f"({', '.join(f'{k} {v:.3f}' for k, v in per_stage.items())})", flush=True)
            report["trunk"].update(ms_per_sample=ms, ms_per_sample_by_stage=per_stage)
        report["epochs"].append({
            "epoch": epoch, "loss": loss, "train_acc": train_acc,
            "val_acc": None if val_acc != val_acc else val_acc,
            "train_samples": n, "train_s": t_train, "wall_s": wall,
            "samples_per_s": n / t_train if t_train > 0 else None,
            "loader_wait_s": wait, "trunk_ms_per_sample": ms})
        trunk.reset_timing()
        if args.report:
            write_report(args.report, report)

    # chance: always answering the most frequent class of the validation set
    val_labels = [ds.targets[i] for i in val_ds.indices]
    chance = max(np.bincount(val_labels)) / len(val_labels) if val_labels else float("nan")
    print(f"final val_acc {val_acc:.3f} (chance {chance:.3f})")
    if args.report:
        report["final_val_acc"] = None if val_acc != val_acc else val_acc
        report["chance"] = None if chance != chance else float(chance)
        write_report(args.report, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
