"""bench/bench-e2e --quick end to end: one cluster, the usual pipeline and hapifs (split=auto on
the storage node, -o remote on the compute node) each for 2 epochs of the same script.

A smoke test of the benchmark, not of its figures' size: it checks that both runs read every
image in every epoch, that hapifs's later epoch moved no pack over the link, and that the table
agrees with the JSON."""
import json
import subprocess

import pytest

from test_cluster import need_tiers
from conftest import PYTHON, SOURCE_ROOT

BENCH = SOURCE_ROOT / "bench" / "bench-e2e"


def test_bench_e2e_quick(tmp_path):
    need_tiers()
    out = tmp_path / "e2e.json"
    r = subprocess.run([PYTHON, str(BENCH), "--quick", "--work", str(tmp_path / "work"),
                        "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 1
    c = cells[0]
    assert (c["model"], c["link"], c["speed"]) == ("resnet18", "1gbit/1ms", 1.0)
    assert 1 <= c["split"]["index"] <= c["split"]["freeze"], c["split"]
    for name in ("usual", "hapifs"):
        run = c["runs"][name]
        assert run["samples"] == 40 and len(run["epochs"]) == 2, (name, run)
        assert all(e["samples"] == 40 and e["wall_s"] > 0 for e in run["epochs"]), (name, run)
    # epoch 2 of hapifs reads the compute node's own cache: no pack crosses the link
    assert c["runs"]["hapifs"]["epochs"][1]["link_bytes"] < 20000, c["runs"]["hapifs"]
    assert c["remote_stats"]["packs"] >= 1, c["remote_stats"]
    u, h = c["runs"]["usual"], c["runs"]["hapifs"]
    assert c["time_ratio"] == pytest.approx(u["epochs_s"] / h["epochs_s"])
    assert f"| resnet18 | 1gbit/1ms | 1x | {c['split']['stage']} | {u['epochs_s']:.1f} | " \
           f"{h['epochs_s']:.1f} | {c['time_ratio']:.2f}x |" in r.stdout
