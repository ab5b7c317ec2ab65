"""bench/bench-tenants --quick: several mounts with different models computing at once, through
one node file, against the same work one mount after another (a smoke run of the benchmark)."""
import json
import os
import subprocess

from conftest import BUILD_ROOT, PYTHON, SOURCE_ROOT, need_hapifs


def test_bench_tenants_quick(tmp_path):
    need_hapifs()
    env = dict(os.environ, HAPI_BUILD_ROOT=str(BUILD_ROOT))
    r = subprocess.run([PYTHON, str(SOURCE_ROOT / "bench" / "bench-tenants"), "--quick",
                        "--work", str(tmp_path), "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=900, env=env)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0
    out = json.loads((tmp_path / "out.json").read_text())
    runs = {r["label"]: r for r in out["runs"]}
    assert set(runs) == {"n1", "n3"}
    for r in runs.values():
        assert r["failures"] == [] and r["differ"] == []
        assert r["images"] > 0 and r["wall_s"] > 0
        assert r["over_mem"] == []  # every daemon's RssAnon inside its mem=
    # three mounts drew from the node's budget together, and stayed inside it
    assert 0 < runs["n3"]["node_mem_peak"] <= 12 << 30
    assert not (tmp_path / "node").exists()  # the run's node file is removed at the end
