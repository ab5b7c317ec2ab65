"""bench/bench-epochs --quick end to end: a cluster, the usual pipeline against hapifs.

A smoke test of the benchmark, not of its figures' size: it checks that the table has the usual
and hapifs rows with positive figures and that hapifs moved fewer bytes over the links; and, with
--compute-cache, that a compute node which keeps none of the files reads them again every epoch.
"""
import argparse
import json
import re
import subprocess
import time
from pathlib import Path

from test_cluster import dataset, need_cluster  # noqa: F401 (dataset: a fixture)
from conftest import PYTHON, SOURCE_ROOT, load_tool

BENCH = SOURCE_ROOT / "bench" / "bench-epochs"


def rows(out):
    """{(run, epoch): (wall s, images/s, MB)} from the markdown tables."""
    got = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not re.match(r"(usual|hapifs)", cells[0]):
            continue
        run, _, epoch, wall, rate, mbytes = cells
        got[(run, epoch)] = (float(wall), None if rate == "-" else float(rate), float(mbytes))
    return got


def test_quick(tmp_path):
    need_cluster()
    r = subprocess.run([PYTHON, str(BENCH), "--quick", "--work", str(tmp_path / "work"),
                        "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = rows(r.stdout)
    for run in ("usual", "hapifs (policy)"):
        for epoch in ("1", "2", "total"):
            assert (run, epoch) in got, f"no row {run} epoch {epoch}:\n{r.stdout}"
            wall, rate, mbytes = got[(run, epoch)]
            assert wall > 0 and rate > 0, (run, epoch, got[(run, epoch)])
        assert got[(run, "1")][2] > 0  # epoch 1 is cold: bytes crossed the link
    assert got[("hapifs (policy)", "total")][2] < got[("usual", "total")][2], r.stdout
    assert "speed-up" in r.stdout and "policy: split" in r.stdout
    assert (tmp_path / "out.json").exists()


def test_compute_cache_budget(tmp_path):
    """--compute-cache 0: nothing read stays in the compute node's page cache, so every epoch
    of the usual pipeline sends its JPEGs again (on this machine the node otherwise keeps them
    all after epoch 1, and a later epoch sends only sshfs's per-open requests)."""
    need_cluster()
    r = subprocess.run([PYTHON, str(BENCH), "--quick", "--splits", "policy", "--compute-cache",
                        "0", "--work", str(tmp_path / "work"), "--json", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = rows(r.stdout)
    e1, e2 = got[("usual", "1")][2], got[("usual", "2")][2]
    assert e2 >= 0.8 * e1, f"usual epoch 2 moved {e2} MB against {e1} MB in epoch 1:\n{r.stdout}"
    h1, h2 = got[("hapifs (policy)", "1")][2], got[("hapifs (policy)", "2")][2]
    assert h2 < e2 and h1 < e1, r.stdout
    assert "compute node's page cache limited to 0.000 MB" in r.stdout, r.stdout
    runs = json.loads((tmp_path / "o.json").read_text())["results"][0]["runs"]
    for run in runs:
        cc = run["compute_cache"]
        assert cc["budget_bytes"] == 0 and cc["files"] > 0, run["run"]
        assert cc["evicted_files"] >= cc["files"], (run["run"], cc)  # every file, every epoch


def test_run_training_samples_and_stops(tmp_path, dataset, models):
    """run_training on a real cluster: a callable sampled before epoch 1 and after each epoch,
    and a run over its limit stopped with its DataLoader workers, the epochs that ended kept."""
    need_cluster()
    be = load_tool("bench-epochs")
    args = argparse.Namespace(storage=1, opts="", sshfs_opts="")
    cl = be.Cluster(args, "t")
    src, _ = dataset
    train = SOURCE_ROOT / "examples" / "train.py"
    try:
        cl.up(src, models(), "1gbit", "split=auto")
        cl.settled()

        def cmd(epochs, report):
            return [PYTHON, str(train), str(cl.root), "--epochs", str(epochs), "--batch-size",
                    "4", "--workers", "2", "--seed", "0", "--report", str(report)]
        whole = be.run_training(cl, cmd(2, tmp_path / "a.json"), tmp_path / "a.json",
                                tmp_path / "a.log", sample=time.monotonic)
        assert "stopped_s" not in whole and len(whole["epochs"]) == 2
        marks = whole["samples"]  # before epoch 1, after epoch 1, after epoch 2
        assert len(marks) == 3 and marks[0] < marks[1] < marks[2], marks
        # the marks span the epochs, plus what is not in an epoch's wall_s (the report written
        # between epochs, the poll's own lag: each some ms, more on a busy core); marks taken
        # anywhere else (all at the end, or all at once) would be an epoch or more off
        span = marks[2] - marks[0]
        assert abs(span - whole["epochs_s"]) < 0.5 + 0.25 * whole["epochs_s"], \
            (marks, whole["epochs_s"])

        def trainers():  # train.py and its DataLoader workers (forked: the same command line)
            found = []
            for pid in subprocess.run(["ip", "netns", "pids", f"{cl.prefix}-compute"],
                                      capture_output=True, text=True).stdout.split():
                try:
                    if str(train) in Path(f"/proc/{pid}/cmdline").read_text():
                        found.append(pid)
                except OSError:
                    pass  # gone meanwhile
            return found

        # Room for an epoch of the second run even if it is a few times slower than the first
        # run's slower one (a busy core, the node's page cache), and still less than the many
        # epochs asked for by far (each forks its DataLoader workers: far more than 5 ms).
        limit = max(3 * max(e["wall_s"] for e in whole["epochs"]), 5.0)
        many = 1000
        t0 = time.monotonic()
        cut = be.run_training(cl, cmd(many, tmp_path / "b.json"), tmp_path / "b.json",
                              tmp_path / "b.log", sample=time.monotonic, limit_s=limit,
                              epochs=many)
        # stopped at the limit: the poll (every 10 ms, a report read and the link counters)
        # sees it late by far less than these seconds
        assert limit <= cut["stopped_s"] < limit + 5.0, (limit, cut["stopped_s"])
        assert time.monotonic() - t0 < limit + 60
        assert 1 <= len(cut["epochs"]) < many and len(cut["samples"]) == len(cut["epochs"]) + 1, \
            (limit, cut["stopped_s"], [e["wall_s"] for e in cut["epochs"]])
        # stopped_s counts from when the poll saw the first report, written just before epoch
        # 1: on a busy core that can be after train.py's clock for epoch 1 started, hence the
        # small slack
        assert cut["epochs_s"] == sum(e["wall_s"] for e in cut["epochs"]) <= \
            cut["stopped_s"] + 0.5, (cut["epochs_s"], cut["stopped_s"])
        assert cut["epochs"][0]["link_bytes"] > 0  # sshfs's opens cross the link, cached or not
        # nothing of the stopped run (train.py, its workers) is left in the compute node (sshfs
        # may have opened another ssh connection meanwhile: that is the node's own)
        end = time.monotonic() + 30  # SIGKILLed workers may take a moment to go
        while trainers() and time.monotonic() < end:
            time.sleep(0.1)
        assert trainers() == [], "the stopped run's processes are still in the compute node"
    finally:
        cl.down()
