"""bench/bench-nodes --quick end to end: clusters of 1 and 2 storage nodes, each in a cgroup of
its own at a CPU quota, a compute-side -o remote mount over them, every .feat read once.

A smoke test of the benchmark, not of its figures' size: it checks that every image was read
and computed once, each node count has its rate, and the table agrees with the JSON."""
import json
import os
import subprocess

import pytest

from test_cluster import need_tiers
from conftest import PYTHON, SOURCE_ROOT

BENCH = SOURCE_ROOT / "bench" / "bench-nodes"


def test_bench_nodes_quick(tmp_path):
    need_tiers()
    out = tmp_path / "nodes.json"
    r = subprocess.run([PYTHON, str(BENCH), "--quick", "--work", str(tmp_path / "work"),
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads(out.read_text())
    runs = got["runs"]
    assert [run["nodes"] for run in runs] == [1, 2]
    for run in runs:
        # every image read once through the remote mount, each computed once by its node
        assert run["files"] == 48 and run["computed"] == 48, run
        assert run["bytes"] > 0 and run["wall_s"] > 0 and run["rate"] > 0, run
        assert run["storage_cpu_s"] > 0, run
        assert f"| {run['nodes']} | {run['wall_s']:.1f} | {run['rate']:.1f} | " \
               f"{run['scaling']:.2f}x |" in r.stdout
    assert runs[0]["scaling"] == pytest.approx(1.0)
    assert abs(runs[1]["scaling"] - runs[1]["rate"] / (2 * runs[0]["rate"])) < 1e-9
    # no node's cgroup is left behind (cgroup v1's cpu hierarchy, or v2's one)
    for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup"):
        if os.path.isdir(root):
            assert not [d for d in os.listdir(root) if d.startswith("hapifs-cluster-hbn")], root
