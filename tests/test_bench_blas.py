"""bench/bench-blas --quick: the installed BLAS alternatives timed side by side (a smoke run)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import BUILD_ROOT, PYTHON, SOURCE_ROOT

LIB = Path("/usr/lib/x86_64-linux-gnu")


def test_bench_blas_quick(tmp_path):
    if not (BUILD_ROOT / "bench" / "model-time").exists():
        pytest.skip("bench/model-time is not built")
    # the two that tools/install-deps installs: no download
    names = [n for n, d in (("reference", "blas"), ("openblas-openmp", "openblas-openmp"))
             if (LIB / d / "libblas.so.3").exists()]
    assert names, "no BLAS installed?"
    env = dict(os.environ, HAPI_BUILD_ROOT=str(BUILD_ROOT))
    r = subprocess.run([PYTHON, str(SOURCE_ROOT / "bench" / "bench-blas"), "--quick",
                        "--blas", ",".join(names), "--work", str(tmp_path),
                        "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=600, env=env)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0
    out = json.loads((tmp_path / "out.json").read_text())["results"]["resnet18"]
    for n in names:
        # each ran with the BLAS it was given (the tool checks it too), every stage timed
        assert out[n]["blas"] == n and out[n]["batches"] == [1, 2]
        assert [s["name"] for s in out[n]["stages"]] == [s["name"] for s in out[names[0]]["stages"]]
        assert all(ms > 0 for s in out[n]["stages"] for ms in s["ms_per_image"])
    assert "fastest:" in r.stdout
