#!/usr/bin/python3
"""Measures this (compute) node's speed relative to the storage node that serves ROOT.

    probe-speed.py ROOT [--model auto|PATH] [--threads N] [--batch 32] [--seconds 3] [--json]

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

Prints a table per stage and two last lines, "client_speed X" and
"compute_stages MS,MS,..."; pass them on to the storage node, where the mount's
control file is writable:

    hapifs-ctl set-client-speed X /mnt/feat        (on the storage node)
    hapifs-ctl set-compute-stages MS,MS,... /mnt/feat

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
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error("--batch must be at least 1")

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
    train, train_runs = (here, runs) if args.batch == batch else per_stage(args.batch)
    rows = []
    for s, name, ms, ms_train in zip(stages, trunk.names, here, train):
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
           "train_runs": train_runs, "compute_stages_ms": train}
    stages_line = ",".join(f"{ms:.4g}" for ms in train)
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
    print(f"{'total':<12} {storage:>10.3f} {compute:>10.3f} {speed:>7.2f} {sum(train):>10.3f}")
    print(f"client_speed {speed:.3g}")
    print(f"compute_stages {stages_line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
