"""Smoke test of bench/bench: a tiny run (--quick) prints every row with positive numbers."""
import json
import os
import re
import subprocess

import pytest

from conftest import BUILD_ROOT, HAPIFS, PYTHON, SOURCE_ROOT

BENCH = SOURCE_ROOT / "bench" / "bench"
# Row names as regular expressions: the batched ceiling is at the daemon's batch size.
ROWS = [r"ceiling b1 ", r"ceiling b(?!1 )\d+ ", "usual", "hapifs cold", "hapifs warm remount",
        "hapifs warm kernel cache", r"plain \.npy files", "bytes JPEG", r"bytes \.feat fp16",
        r"bytes \.feat fp32",
        "FUSE floor first pass", "FUSE floor kernel cache"]
RATIOS = [r"cold/ceiling_b1", r"cold/ceiling_b(?!1$)\d+", "cold/usual", "warm_remount/plain",
          "jpeg/feat_fp16", "jpeg/feat_fp32",
          "warm_remount/floor_first", "floor_first/plain", "floor_kernel/plain"]


def test_bench_quick(tmp_path):
    if not HAPIFS.exists() or not (BUILD_ROOT / "tests" / "hapi-features").exists() \
            or not (BUILD_ROOT / "bench" / "fuse-floor").exists():
        pytest.skip(f"hapifs or hapi-features is not built in {BUILD_ROOT} (set HAPI_BUILD_ROOT)")
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("the bench mounts: it needs /dev/fuse and root")
    out = tmp_path / "bench.json"
    env = dict(os.environ, HAPI_BUILD_ROOT=str(BUILD_ROOT))
    # --quick still exports a model, profiles it and mounts several times: well under a minute
    # here, several on a slow or busy machine; the timeout is only for a run that hangs
    r = subprocess.run([PYTHON, str(BENCH), "--quick", "--work", str(tmp_path / "work"),
                        "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for row in ROWS:
        line = next((ln for ln in lines if re.match(row, ln)), None)
        assert line, f"row {row!r} missing from:\n{r.stdout}"
        value = float(re.split(r"\s{2,}", line.strip())[-1])
        assert value > 0, line
    assert re.search(r"^computed cold/warm.* 12/0;", r.stdout, re.M), r.stdout

    res = json.loads(out.read_text())["results"]["resnet18/pool"]
    for ratio in RATIOS:
        name = next((k for k in res["ratios"] if re.fullmatch(ratio, k)), None)
        assert name and res["ratios"][name] > 0, (ratio, res["ratios"])
    checks = res["checks"]
    assert (checks["cold_computed"], checks["warm_computed"], checks["ok"]) == (12, 0, True)
    assert not any(str(tmp_path) in ln for ln in open("/proc/self/mounts")), \
        "bench left a mount behind"
