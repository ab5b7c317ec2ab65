"""bench/bench-policy --grid --quick end to end: tiers on their own CPUs, the measured client
speed, every run of the cell, and the grid's table.

A smoke test of the benchmark, not of its figures' size: it checks that the cell was measured
with the client speed measured and handed to the policy, that the quota held the storage
tier back, that the earliest split moved more bytes than the last, and that the table, the runs
and the summary are printed and agree with the JSON.
"""
import json
import math
import subprocess

import pytest

from test_cluster import need_tiers
from conftest import PYTHON, SOURCE_ROOT, load_tool

BENCH = SOURCE_ROOT / "bench" / "bench-policy"


def test_grid_quick(tmp_path):
    need_tiers()
    out = tmp_path / "grid.json"
    # --splits: the last frozen split, then stem, in that order (and the pick after them);
    # --ties 1: those within 10% of the best once more; --cutoff 0: every run to its end (the
    # splits' times here are too close for a stop to be sure: test_bench_epochs checks a stop)
    r = subprocess.run([PYTHON, str(BENCH), "--grid", "--quick", "--work", str(tmp_path / "work"),
                        "--splits", "pool,stem", "--ties", "1", "--cutoff", "0", "--json",
                        str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 1
    c = cells[0]
    assert (c["model"], c["link"], c["rtt"], c["speed_set"]) == ("resnet18", "1gbit", "0", 4.0)
    # measured, not assumed, and handed to the policy as measured. Its size is not checked: it
    # is the compute tier's speed over the throttled storage tier's, and on a busy machine (the
    # sanitizer lane runs beside this test) the unthrottled tier loses most (1.37 seen, ~4 quiet).
    # That the quota held the storage tier back is checked by each run's throttled time below.
    assert math.isfinite(c["client_speed"]) and c["client_speed"] > 0, c["client_speed"]
    assert c["inputs"]["client_speed"] == pytest.approx(c["client_speed"], rel=1e-3)
    # and the training loop's CPU per file, handed to the policy as measured
    loop = c["probe_loop"]
    assert loop["passes"] >= 2 and loop["files_read"] > loop["files"] > 0, loop
    assert c["inputs"]["compute_file_ms"] == pytest.approx(loop["compute_file_ms"], rel=1e-3)
    runs = {run["split"]: run for run in c["runs"]}
    order = [run["split"] for run in c["runs"]]
    assert order[:2] == [c["freeze"], 1] and order[2:] in ([], [c["pick"]]), order
    assert all(run["storage_stats"]["batcher"]["samples"] > 0 for run in c["runs"])
    assert c["pick"] in runs and c["best"] in runs and c["freeze"] in runs and 1 in runs
    for run in runs.values():
        assert run["epochs_s"] > 0 and run["predicted_s"] > 0 and len(run["epoch_s"]) == 2
        assert run["link_bytes"] > 0 and run["compute_cpu_s"] > 0
        assert run["storage_throttled_s"] > 0, run  # the quota held the storage tier back
        assert run["profile"] == "stored", run  # the cell's profile, not measured again
        assert run["stopped_s"] is None and set(run["repeats_stopped_s"]) == {None}
        # each tier's CPU before epoch 1 and in each epoch, within the run's
        for tier in ("storage", "compute"):
            by_epoch = run[f"{tier}_cpu_s_by_epoch"]
            assert len(by_epoch) == 3 and min(by_epoch) >= 0, (tier, by_epoch)
            assert sum(by_epoch) <= run[f"{tier}_cpu_s"] + 1e-6, (tier, by_epoch, run)
        assert run["storage_cpu_s_by_epoch"][1] > 0  # epoch 1 computed the features
        assert len(run["storage_throttled_s_by_epoch"]) == 3
    assert runs[1]["link_bytes"] > runs[c["freeze"]]["link_bytes"]  # stem's features are larger
    # the ties: every split whose first run was within 10% of the best first run, if two or
    # more, and those the policy predicted within 5% of its pick; with the pick
    first = {s: run["repeats_epochs_s"][0] for s, run in runs.items()}
    near = {s for s, t in first.items() if t <= min(first.values()) * 1.10}
    guessed = {s for s, run in runs.items() if s != c["pick"] and first[s] is not None
               and run["predicted_s"] <= runs[c["pick"]]["predicted_s"] * 1.05}
    want = sorted(near | guessed | {c["pick"]}) if len(near) > 1 or guessed else []
    assert sorted(c["tie_splits"]) == want, (first, c["pick"], c["tie_splits"])
    for s, run in runs.items():
        assert len(run["repeats_epochs_s"]) == (2 if s in c["tie_splits"] else 1), (s, run)
        assert run["epochs_s"] == min(run["repeats_epochs_s"])  # of two, the faster
    assert c["ties"] == 1 and c["cutoff"] == 0 and not c["pick_stopped"]
    assert c["time_ratio"] >= 1.0
    # the job's whole time: train.py's start-up is outside its epochs
    assert all(run["startup_s"] > 0 for run in c["runs"])
    assert c["best_job"] in runs and c["job_time_ratio"] >= 1.0
    assert "by the job's whole time" in r.stdout
    assert abs(c["time_ratio"] - runs[c["pick"]]["epochs_s"] / runs[c["best"]]["epochs_s"]) < 1e-9
    row = [line for line in r.stdout.splitlines() if line.startswith("| resnet18 | 1gbit | 0 |")]
    assert len(row) == 1 and f"| {c['pick']} {c['pick_stage']} |" in row[0], r.stdout
    # one round: the round's pick/best is over the first runs, the cell's too unless ties ran
    # again (then the cell's is over their medians), and the table's last column says so
    assert len(c["round_time_ratios"]) == 1
    assert abs(c["round_time_ratios"][0] - first[c["pick"]] / min(first.values())) < 1e-9
    if not c["tie_splits"]:
        assert abs(c["round_time_ratios"][0] - c["time_ratio"]) < 1e-9
    assert row[0].endswith(f"| {c['round_time_ratios'][0]:.2f} |"), row[0]
    assert "1 cells: pick within 5% of the measured best in" in r.stdout
    assert f"every split measured ({len(runs)} runs)" in r.stdout, r.stdout

    # --resume: the cell in the file is kept, not measured again, and printed with the grid
    again = subprocess.run([PYTHON, str(BENCH), "--grid", "--quick", "--work",
                            str(tmp_path / "work"), "--json", str(out), "--resume"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "# resumed: 1 cells" in again.stdout, again.stdout
    assert "] split " not in again.stderr, again.stderr  # no split ran
    assert json.loads(out.read_text())["cells"] == cells
    assert row[0] in again.stdout.splitlines()
    assert "1 cells: pick within 5% of the measured best in" in again.stdout
    # a grid measured with other settings is not mixed in
    other = subprocess.run([PYTHON, str(BENCH), "--grid", "--quick", "--work",
                            str(tmp_path / "work"), "--json", str(out), "--resume",
                            "--storage-cpus", "1", "--compute-cpus", "0"],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode != 0
    assert "was measured with --storage-cpus 0, --compute-cpus 1" in other.stderr, other.stderr

    # --replay: the cell keeps its profile, and this build's policy (bench/policy-eval) on it
    # and the cell's inputs predicts every split as the daemon did when the cell was measured
    assert c["profile"]["stages"] and c["profile"]["model_digest"]
    replay = subprocess.run([PYTHON, str(BENCH), "--replay", "--json", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr[-2000:]
    assert "1 of 1 cells keep their profile" in replay.stdout, replay.stdout
    assert "cells whose every split is predicted as when measured: 1 of 1" in replay.stdout
    assert f"| {c['pick_stage']} / {c['pick_stage']} |" in replay.stdout, replay.stdout
    # an input changed first: another prediction; an input the policy does not have: refused
    far = subprocess.run([PYTHON, str(BENCH), "--replay", "--json", str(out), "--set",
                          "rtt_ms=50"], capture_output=True, text=True, timeout=120)
    assert far.returncode == 0, far.stderr[-2000:]
    assert "with rtt_ms=50" in far.stdout
    assert "cells whose every split is predicted as when measured: 0 of 1" in far.stdout
    bad = subprocess.run([PYTHON, str(BENCH), "--replay", "--json", str(out), "--set",
                          "rtt=50"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and 'the inputs have no "rtt"' in bad.stderr, bad.stderr


def test_contenders_are_measured_or_predicted_near_ties():
    """--ties runs again the splits within 10% of the best run, and those the policy predicts
    within 5% of its pick unless --cutoff stopped them; the pick with them."""
    bp = load_tool("bench-policy")

    def run(t):
        return {"epochs_s": t, "stopped_s": None if t else 150.0}
    cands = {1: {"total_s": 100}, 2: {"total_s": 104}, 3: {"total_s": 120}, 4: {"total_s": 103}}
    # the pick (1) best, 2 measured 30% behind: only its prediction makes it a contender
    assert bp.contenders(1, {1: run(100), 2: run(130), 3: run(200)}, cands, 2) == [1, 2]
    # a predicted near tie that was stopped is none, and the pick alone runs no more
    assert bp.contenders(1, {1: run(100), 4: run(None), 3: run(200)}, cands, 2) == []
    assert bp.contenders(1, {1: run(100), 3: run(108)}, cands, 2) == [1, 3]
    # measured within 10% without the pick (20% behind), 4 also predicted near: the pick runs
    # with them
    assert bp.contenders(1, {1: run(120), 2: run(130), 3: run(100), 4: run(109)},
                         {**cands, 2: {"total_s": 110}}, 2) == [1, 3, 4]
    # no --ties: none
    assert bp.contenders(1, {1: run(100), 2: run(101)}, cands, 0) == []


def test_rescore_takes_the_measured_runs():
    """--replay scores another pick against the runs the cell measured: the best stays, the
    pick's run and prediction change; a pick the cell did not run, or a stopped one, has no
    prediction ratio."""
    bp = load_tool("bench-policy")

    def run(split, t, stopped=None, process=None):
        return {"split": split, "epochs_s": t, "stopped_s": stopped,
                "process_s": process or (t or stopped) + 5}
    cell = {"runs": [run(1, 100.0), run(2, 110.0), run(3, None, stopped=160.0)],
            "pick": 1, "pick_stage": "a", "time_ratio": 1.0, "round_time_ratios": [1.0],
            "best_is_last": False, "best_job_stage": "a"}

    def pol(pick, total):
        return {"choice": {"split": pick, "stage": "abc"[pick - 1]}, "why": "w",
                "candidates": [{"split": s, "total_s": total} for s in (1, 2, 3)]}
    a = bp.rescore(cell, pol(2, 99.0))
    assert a["pick"] == 2 and a["pick_stage"] == "b" and a["replayed"]
    assert a["time_ratio"] == pytest.approx(1.10)
    assert a["predicted_over_measured"] == pytest.approx(0.90)
    assert a["job_time_ratio"] == pytest.approx(115 / 105)
    assert a["predicted"] == {1: 99.0, 2: 99.0, 3: 99.0} and a["round_time_ratios"] == []
    assert cell["pick"] == 1  # the cell itself unchanged
    stopped = bp.rescore(cell, pol(3, 99.0))
    assert stopped["time_ratio"] == pytest.approx(1.60) and stopped["pick_stopped"]
    assert stopped["predicted_over_measured"] is None
    unrun = bp.rescore(cell, dict(pol(1, 99.0), choice={"split": 4, "stage": "d"}))
    assert unrun["time_ratio"] is None and unrun["predicted_over_measured"] is None
    bp.summarize([a, stopped, unrun])  # a pick without a ratio counts as a miss, not a crash
