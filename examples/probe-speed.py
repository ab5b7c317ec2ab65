#!/usr/bin/python3
"""Measures this (compute) node's speed relative to the storage node that serves ROOT.

    probe-speed.py ROOT [--model auto|PATH] [--threads N] [--batch 32] [--seconds 3]
                   [--files 128] [--json]

The policy of a hapifs mount weighs moving frozen stages to the compute tier by
client_speed, the compute tier's speed relative to the storage node. This measures
it, where the training runs: the frozen stages [0, freeze) of the mount's model
(its .hapifs/model, or --model PATH, checked against the mount as train.py does),
frozen and fused as the daemon runs them, timed stage by stage on random inputs,
for about --seconds at each of two batches. At the largest batch of the storage
node's profile (.hapifs/profile: the same stages, measured at mount), the speed
is the ratio of the sums, so the stages that cost the most weigh the most:

    client_speed = sum(storage ms per sample) / sum(compute ms per sample)

At the training loop's batch (--batch, train.py's default 32), each stage's ms
per sample: what the policy charges the compute tier for the stages it runs.
The two batches differ where the storage node's profile stops early (under a CPU
quota it may stop at 4), and a stage costs per sample at 4 up to twice what it
does at 32 (VGG-16's fc6).

Then the training loop's own cost per file beside those stages (the policy's
compute_file_ms): what reading a .feat file costs this node's CPUs (the network
filesystem and ssh, the DataLoader's workers, numpy.load, collation) with the
head's step on it. --files files of ROOT (a few from each class folder) are
read through a DataLoader as train.py reads them (its workers, its batch, the
mount's trunk [split, freeze) when the split is before the freeze point, the
head trained on the rest), once to warm up (this computes their features on
the storage node unless they are cached, and with prefetch=dir the rest of
their folders: the probe then waits, up to --settle seconds, until the storage
node computes nothing, since reads that wait on it make the loop cost more
CPU a file) and then again and again for about --seconds. The CPU of every
CPU this process may use (/proc/stat, so the network filesystem's and ssh's
work counts) over those passes, less the trunk's (its own process CPU time)
and less what those CPUs do at rest (other processes and kernel threads,
measured over --rest seconds before the passes, at that rate), per file read,
is the loop's cost per file; the policy charges a file's bytes
apart (compute_load_ns, compute_byte_ns, read from the mount's .hapifs/policy),
so they are taken out of it. train.py, as most training scripts, starts its
DataLoaders' workers anew every epoch: a cost per epoch, whatever its files, so
the same passes run again with new workers each, and the difference per pass
(start) is spread over the tree's samples (the policy's inputs). A difference of
two noisy figures can come out below what starting the workers surely costs (once
below zero): start is at least the CPU that starting and stopping the same
loaders' workers over no files takes this process and its children (getrusage,
which no other process's work touches):

    compute_file_ms = (CPU - rest - trunk CPU) / files - bytes * load_ns
                      - bytes received (/proc/net/dev) / files * byte_ns
                      + start / samples

A later epoch of train.py is what it measures (the files kept in this node's
page cache as far as the filesystem keeps them). Another process's CPU counts
only as far as it is not steady: the rest's rate is what is taken out, and a
slow loop (a storage node that serves few files a second) is where it matters:
a background of 2% of a CPU is 0.7 ms a file at 30 files a second. --files 0
skips it.

Prints a table per stage and three last lines, "client_speed X",
"compute_stages MS,MS,..." and "compute_file_ms MS"; pass them on to the storage
node, where the mount's control file is writable:

    hapifs-ctl set-client-speed X /mnt/feat        (on the storage node)
    hapifs-ctl set-compute-stages MS,MS,... /mnt/feat
    hapifs-ctl set-compute-file-ms MS /mnt/feat

It is measured, not written through the mount: the compute node reads hapifs
through a read-only network filesystem, and the control file takes commands only
from the storage node's root or ctl_group. --threads defaults to what train.py
runs its trunk with (the CPUs this process may use, less one per DataLoader
worker, --workers 2), so that the figure is the trunk's speed in training.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def cpu_busy_s(cpus):
    """Seconds the CPUs numbered in cpus have been busy since boot: user, nice, system, irq
    and softirq (not idle, not waiting for I/O, not stolen by a hypervisor)."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            w = line.split()
            if w and w[0][:3] == "cpu" and w[0][3:].isdigit() and int(w[0][3:]) in cpus:
                v = [int(x) for x in w[1:8]]
                busy += v[0] + v[1] + v[2] + v[5] + v[6]
    return busy / os.sysconf("SC_CLK_TCK")


def received_bytes():
    """Bytes received by this network namespace's interfaces other than lo."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, data = line.partition(":")
            if data and name.strip() != "lo":
                total += int(data.split()[0])
    return total


def sample_files(root, n):
    """Up to n (path, label) of ROOT/<class>/*.feat, a few from each class folder in order
    (so that a tree of a thousand folders is not listed whole), labels by folder."""
    classes = sorted(e.name for e in os.scandir(root)
                     if not e.name.startswith(".") and e.is_dir())
    per = max(8, -(-n // max(len(classes), 1)))
    files = []
    for label, name in enumerate(classes):
        d = os.path.join(root, name)
        feats = sorted(e.name for e in os.scandir(d) if e.name.endswith(".feat"))
        files += [(os.path.join(d, f), label) for f in feats[:min(per, n - len(files))]]
        if len(files) >= n:
            break
    return files


class FeatureFiles:
    """The files as train.py's DatasetFolder gives them: np.load, then to fp32."""

    def __init__(self, files, load, to_tensor):
        self.files, self.load, self.to_tensor = files, load, to_tensor

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path, label = self.files[i]
        return self.to_tensor(self.load(path)), label


class TimedTrunk:
    """Calls a trunk, adding up this process's CPU time (all its threads) spent in its stages."""

    def __init__(self, trunk):
        self.trunk, self.cpu_s = trunk, 0.0

    def __call__(self, x):
        if not self.trunk.names:  # no stages: the input as it is, nothing to take out
            return self.trunk(x)
        t = time.process_time()
        y = self.trunk(x)
        self.cpu_s += time.process_time() - t
        return y


def storage_busy(ctl):
    """What the storage node's batcher still has to compute (queued and in flight), from the
    mount's .hapifs/stats; 0 where it says nothing of it (a compute-side -o remote mount)."""
    try:
        with open(os.path.join(ctl, "stats")) as f:
            batcher = json.load(f).get("batcher", {})
    except (OSError, ValueError):
        return 0
    return sum(batcher.get("queued", {}).values()) + batcher.get("in_flight", 0)


def settle(ctl, limit_s):
    """Waits (up to limit_s) until the storage node computes nothing: the warm-up's reads make it
    compute the rest of their folders (prefetch=dir), and reads meanwhile wait on it, so that
    the loop would run slower, and a slower loop costs more CPU a file (measured: 3.9 ms a file
    with the storage tier busy, 1.0-1.4 once it was idle). Returns (seconds waited, work still
    left)."""
    t0 = time.monotonic()
    left = storage_busy(ctl)
    while left and time.monotonic() - t0 < limit_s:
        time.sleep(0.5)
        left = storage_busy(ctl)
    return time.monotonic() - t0, left


def workers_start_s(args, ds, with_val, reps=3):
    """The CPU (this process's and its children's, getrusage) that starting and stopping
    train.py's loaders' workers costs an epoch, over no files: the least an epoch's start
    costs, measured without any other process's work in it."""
    import resource
    from torch.utils.data import DataLoader, Subset

    def cpu_s():
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))
    t0 = cpu_s()
    for _ in range(reps):
        for _ in range(2 if with_val else 1):
            for _ in DataLoader(Subset(ds, []), batch_size=args.batch, num_workers=args.workers):
                pass
    return (cpu_s() - t0) / reps


def loop_cost(args, root, ctl, config, trunk):
    """The training loop's CPU per file on this node beside the trunk (see the top)."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Subset
    import train

    files = sample_files(root, args.files)
    if len(files) < 2:
        raise train.TrunkError(f"{root}: {len(files)} .feat file(s) in its class folders, "
                               "the loop's cost needs at least 2 (--files 0 skips it)")
    split, freeze = int(config["split"]["index"]), int(config["split"]["freeze"])
    tail = TimedTrunk(train.StageTrunk(list(zip(trunk.names[split:freeze],
                                                trunk.stages[split:freeze])), start=split))
    tail.trunk.ctl, tail.trunk.split = ctl, config["split"]  # for train.split_changed
    ds = FeatureFiles(files, np.load, train.to_float_tensor)
    first = ds[0][0]
    train.check_shape(root, tuple(first.shape), config["split"])
    with torch.no_grad():
        in_features = tail.trunk(first[None]).flatten(1).shape[1]
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    n_val = int(round(len(ds) * 0.2))  # train.py's --val-fraction
    fit, val = order[:len(ds) - n_val], order[len(ds) - n_val:]

    def loaders(persistent):  # train.py's two, with their workers kept across passes or not
        workers = dict(num_workers=args.workers, persistent_workers=persistent)
        return (DataLoader(Subset(ds, fit), batch_size=args.batch, shuffle=True,
                           drop_last=len(fit) > args.batch,
                           generator=torch.Generator().manual_seed(0), **workers),
                DataLoader(Subset(ds, val), batch_size=args.batch, **workers))

    head = train.make_head(in_features, 1 + max(label for _, label in files))
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-3)

    def one_pass(train_loader, val_loader):  # an epoch of train.py: trained, then validated
        try:
            n = train.run_epoch(head, tail, train_loader, optimizer)[2]
            return n + (train.run_epoch(head, tail, val_loader)[2] if val else 0)
        except RuntimeError:  # e.g. features of two shapes in a batch
            changed_split()
            raise

    def changed_split():  # as train.py stops when the mount's split changes under it
        if train.split_changed(tail.trunk):
            raise train.TrunkError(f"the mount's split changed from {split} while the loop was "
                                   "measured; run the probe again")

    kept = loaders(args.workers > 0)
    one_pass(*kept)  # the warm-up: the workers start, the files come across once
    waited, left = settle(ctl, args.settle)
    if left:
        print(f"probe-speed: the storage node still has {left} features to compute after "
              f"{waited:.0f} s (--settle); the loop's cost measured beside it is too high",
              file=sys.stderr)
    cpus = os.sched_getaffinity(0)
    # What these CPUs do while this process waits (other processes, kernel threads: here a
    # hypervisor's memory monitor, kdamond, took 1-6% of a CPU) is no cost of the loop's
    # files, but it runs beside the passes and /proc/stat counts it: measured at rest (the
    # workers idle), and taken out of the passes at its rate.
    rest_rate = 0.0
    if args.rest > 0:
        busy0, t0 = cpu_busy_s(cpus), time.monotonic()
        time.sleep(args.rest)
        rest_rate = (cpu_busy_s(cpus) - busy0) / (time.monotonic() - t0)

    def own(busy, trunk_s, seconds):  # the loop's CPU: less the trunk's and the rest's
        return busy - rest_rate * seconds - trunk_s

    def measure(pair):  # passes for about --seconds: (CPU, trunk CPU, passes, files, s, rx)
        tail.cpu_s, passes, read = 0.0, 0, 0
        busy0, rx0, t0 = cpu_busy_s(cpus), received_bytes(), time.monotonic()
        while passes < 2 or time.monotonic() - t0 < args.seconds:
            read += one_pass(*pair)
            passes += 1
        busy = cpu_busy_s(cpus) - busy0
        return busy, tail.cpu_s, passes, read, time.monotonic() - t0, received_bytes() - rx0

    busy, trunk_s, passes, read, seconds, rx = measure(kept)
    kept = None  # its workers stop
    # train.py starts each loader's workers anew every epoch (DataLoader's default), as most
    # training scripts do: a fork of this process and its exit, per worker. That costs the
    # epoch the same whatever its files (0.7 s of CPU for 2 x 2 workers here), so it is
    # measured apart, as the same passes with new workers each, and spread over the tree's
    # samples (the mount's policy inputs) below.
    start_s = start_floor_s = 0.0
    if args.workers > 0:
        fresh_busy, fresh_trunk_s, fresh_passes, _, fresh_s, _ = measure(loaders(False))
        start_s = (own(fresh_busy, fresh_trunk_s, fresh_s) / fresh_passes
                   - own(busy, trunk_s, seconds) / passes)
        start_floor_s = workers_start_s(args, ds, bool(val))
        start_s = max(start_s, start_floor_s)
    changed_split()
    try:
        with open(os.path.join(ctl, "policy")) as f:
            inputs = json.load(f).get("inputs", {})
    except (OSError, ValueError):
        inputs = {}
    load_ns = float(inputs.get("compute_load_ns", 0.0))
    byte_ns = float(inputs.get("compute_byte_ns", 0.0))
    samples = int(inputs.get("samples", 0))
    file_bytes = sum(os.stat(path).st_size for path, _ in files) / len(files)
    per_file = 1e3 * own(busy, trunk_s, seconds) / read
    received = rx / read
    start_ms = 1e3 * max(start_s, 0.0) / samples if samples else 0.0
    if inputs and not samples and start_s > 0:  # the daemon counts its tree in the background
        print(f"probe-speed: the mount has not counted its tree yet, so the workers' start "
              f"({1e3 * start_s:.0f} ms an epoch) is not in compute_file_ms; probe again once "
              "its .hapifs/policy has samples", file=sys.stderr)
    cost = per_file - file_bytes * load_ns / 1e6 - received * byte_ns / 1e6 + start_ms
    return {"compute_file_ms": max(cost, 0.0), "files": len(files), "passes": passes,
            "files_read": read, "seconds": seconds, "cpus": sorted(cpus), "cpu_s": busy,
            "trunk_cpu_s": trunk_s, "cpu_ms_per_file": per_file, "split": split,
            "rest_s": args.rest, "rest_cpus": rest_rate, "rest_cpu_s": rest_rate * seconds,
            "file_bytes": file_bytes, "received_bytes_per_file": received,
            "compute_load_ns": load_ns, "compute_byte_ns": byte_ns,
            "epoch_start_s": start_s, "epoch_start_floor_s": start_floor_s,
            "samples": samples, "start_ms_per_file": start_ms,
            "policy_inputs": bool(inputs), "settle_s": waited, "storage_left": left}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="a folder on the mount (or the mount through sshfs)")
    ap.add_argument("--model", default="auto", metavar="auto|PATH",
                    help="the archive: auto = the mount's .hapifs/model")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: CPUs this process may use less --workers)")
    ap.add_argument("--workers", type=int, default=2,
                    help="DataLoader workers train.py would run beside the trunk")
    ap.add_argument("--batch", type=int, default=32,
                    help="the training loop's batch (train.py --batch-size)")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="time spent measuring each batch")
    ap.add_argument("--files", type=int, default=128,
                    help="files read to measure the training loop's cost per file (0: not)")
    ap.add_argument("--settle", type=float, default=600.0,
                    help="seconds to wait after the warm-up for the storage node to compute "
                         "nothing more (its prefetch of the files' folders)")
    ap.add_argument("--rest", type=float, default=3.0,
                    help="seconds the CPUs' work at rest is measured before the loop's passes, "
                         "to take it out of them (0: not)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error("--batch must be at least 1")
    if args.files < 0:
        ap.error("--files must be 0 or more")
    if args.rest < 0:
        ap.error("--rest must be 0 or more")

    import torch
    import train

    train.keep_heap()  # as train.py runs its trunk
    cpus = len(os.sched_getaffinity(0))
    threads = args.threads or max(1, cpus - args.workers)
    torch.set_num_threads(threads)
    try:
        ctl, config = train.find_mount_config(args.root)
        if config is None:
            sys.exit(f"probe-speed: {args.root} is not on a hapifs mount (no .hapifs/config)")
        config = train.settled_config(ctl, config, log=lambda m: print(m, file=sys.stderr))
        with open(os.path.join(ctl, "profile")) as f:
            profile = json.load(f)
        if profile.get("state") not in (None, "measured", "stored"):
            sys.exit(f"probe-speed: the storage node has no profile yet ({profile.get('state')})")
        freeze = int(config["split"]["freeze"])
        crop = int(config["preprocess"]["crop"])
        archive = (os.path.join(ctl, "model") if args.model == "auto" else args.model)
        trunk = train.build_trunk(archive, 0, freeze, config=config, feature_shape=(3, crop, crop))
    except train.TrunkError as e:
        sys.exit(f"probe-speed: {e}")

    batch = int(profile["batches"][-1])
    stages = profile["stages"][:freeze]

    def per_stage(b):
        """ms per sample of each stage at batch b, and the runs it took."""
        x = torch.randn(b, 3, crop, crop, generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # warm-up: the profiling executor specializes on the second run
            trunk(x)
        trunk.reset_timing()
        runs, t0 = 0, time.perf_counter()
        while runs < 3 or time.perf_counter() - t0 < args.seconds:
            trunk(x)
            runs += 1
        _, per = trunk.cost()
        return [per[name] for name in trunk.names], runs

    here, runs = per_stage(batch)
    at_batch, train_runs = (here, runs) if args.batch == batch else per_stage(args.batch)
    rows = []
    for s, name, ms, ms_train in zip(stages, trunk.names, here, at_batch):
        rows.append({"stage": name, "storage_ms": float(s["ms_per_sample"][-1]),
                     "compute_ms": ms, "compute_train_ms": ms_train})
    storage = sum(r["storage_ms"] for r in rows)
    compute = sum(r["compute_ms"] for r in rows)
    if not compute > 0:
        sys.exit("probe-speed: the trunk took no measurable time")
    speed = storage / compute
    out = {"client_speed": speed, "batch": batch, "runs": runs, "threads": threads,
           "storage_threads": profile.get("threads"), "freeze": freeze, "stages": rows,
           "storage_ms": storage, "compute_ms": compute, "train_batch": args.batch,
           "train_runs": train_runs, "compute_stages_ms": at_batch, "compute_file_ms": None,
           "loop": None}
    if args.files:
        try:
            out["loop"] = loop_cost(args, args.root, ctl, config, trunk)
        except (train.TrunkError, OSError) as e:
            sys.exit(f"probe-speed: the training loop's cost: {e}")
        out["compute_file_ms"] = out["loop"]["compute_file_ms"]
    stages_line = ",".join(f"{ms:.4g}" for ms in at_batch)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"stages [0, {freeze}), {threads} torch threads here ({profile.get('threads')} on the "
          f"storage node); ms per sample at batch {batch} ({runs} runs) and at the training "
          f"batch {args.batch} ({train_runs} runs):")
    at_train = f"here@{args.batch}"
    print(f"{'stage':<12} {'storage':>10} {'here':>10} {'ratio':>7} {at_train:>10}")
    for r in rows:
        ratio = r["storage_ms"] / r["compute_ms"] if r["compute_ms"] > 0 else float("inf")
        print(f"{r['stage']:<12} {r['storage_ms']:>10.3f} {r['compute_ms']:>10.3f} {ratio:>7.2f} "
              f"{r['compute_train_ms']:>10.3f}")
    print(f"{'total':<12} {storage:>10.3f} {compute:>10.3f} {speed:>7.2f} {sum(at_batch):>10.3f}")
    loop = out["loop"]
    if loop:
        kb = loop["file_bytes"] / 1e3
        print(f"the training loop at split {loop['split']}: {loop['files_read']} files read in "
              f"{loop['passes']} passes over {loop['files']} ({loop['seconds']:.1f} s), "
              f"{loop['cpu_ms_per_file']:.3f} ms CPU a file on CPUs "
              f"{','.join(map(str, loop['cpus']))} (less their work at rest, "
              f"{100 * loop['rest_cpus']:.1f}% of a CPU) beside the trunk's "
              f"{1e3 * loop['trunk_cpu_s'] / loop['files_read']:.3f};\n"
              f"less {kb:.1f} KB loaded at {loop['compute_load_ns']:g} ns/B and "
              f"{loop['received_bytes_per_file'] / 1e3:.1f} KB received at "
              f"{loop['compute_byte_ns']:g} ns/B, plus {1e3 * loop['epoch_start_s']:.0f} ms "
              f"of worker starts an epoch over {loop['samples']} samples: "
              f"{loop['compute_file_ms']:.3f} ms a file"
              + ("" if loop["policy_inputs"] else
                 " (the mount's .hapifs/policy was not readable: bytes not taken out, "
                 "worker starts not counted)"))
    print(f"client_speed {speed:.3g}")
    print(f"compute_stages {stages_line}")
    if loop:
        print(f"compute_file_ms {loop['compute_file_ms']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
