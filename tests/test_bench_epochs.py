"""tools/bench-epochs --quick end to end: a cluster, the usual pipeline against hapifs.

A smoke test of the benchmark, not of its figures' size: it checks that the table has the usual
and hapifs rows with positive figures and that hapifs moved fewer bytes over the links.
"""
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
