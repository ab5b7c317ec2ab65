"""bench/bench-scale --quick end to end: per-file reads through sshfs against -o remote,
with one storage node and with two.

A smoke test of the benchmark: the runs exist with positive figures, the remote mount fetched
packs in epoch 1 and nothing in later epochs, and a second job moved no feature bytes.
"""
import json
import subprocess

from test_cluster import need_cluster
from conftest import PYTHON, SOURCE_ROOT

BENCH = SOURCE_ROOT / "bench" / "bench-scale"


def test_quick(tmp_path):
    need_cluster()
    out = tmp_path / "out.json"
    r = subprocess.run([PYTHON, str(BENCH), "--quick", "--work", str(tmp_path / "work"),
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    one, two = json.loads(out.read_text())["results"]
    res = one
    runs = res["runs"]
    for name in ("per-file sshfs", "remote", "second job", "local files", "storage mount",
                 "usual (raw)"):
        assert name in runs, name
        assert all(e["samples_per_s"] > 0 for e in runs[name]["epochs"]), name
    remote = runs["remote"]["epochs"]
    features = 600 * (res["feat_size"] - 128)
    assert remote[0]["link_bytes"] >= 0.9 * features  # epoch 1 fetched the packs
    assert remote[1]["link_bytes"] < 0.05 * features  # epoch 2: local hits
    assert res["second_job_pack_bytes"] == 0
    assert res["remote_stats"]["packs"] == 6
    assert res["features_equal"] == {"checked": 600, "equal": 600}
    # two storage nodes, each with half the folders: every feature equal to its node's
    assert two["nodes"] == 2
    assert two["features_equal"] == {"checked": 600, "equal": 600}
    assert two["remote_stats"]["packs"] == 12  # files are sharded by hash: each folder on both
    assert all(s["pack_bytes"] > 0 for s in two["remote_stats"]["sources"])
    assert "remote epochs 2+ vs per-file sshfs" in r.stdout
