"""tools/bench-epochs --quick end to end: a cluster, the usual pipeline against hapifs.

A smoke test of the benchmark, not of its figures' size: it checks that the table has the usual
and hapifs rows with positive figures and that hapifs moved fewer bytes over the links; and, with
--compute-cache, that a compute node which keeps none of the files reads them again every epoch.
"""
import json
import re
import subprocess

from test_cluster import need_cluster
from conftest import PYTHON, SOURCE_ROOT

BENCH = SOURCE_ROOT / "tools" / "bench-epochs"


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
