"""bench/soak for 30 s (its 30-minute runs are in docs/deployment.md): 64 readers of .feat files and packs while the split, the cache, the
warm-up and the source change at random; every byte checked, none wrong, no error unexplained."""
import json
import os
import subprocess

import pytest

from conftest import BUILD_ROOT, PYTHON, SOURCE_ROOT, need_hapifs

SOAK = SOURCE_ROOT / "bench" / "soak"


def test_soak_30s():
    need_hapifs()
    features = BUILD_ROOT / "tests" / "hapi-features"
    if not features.exists():
        pytest.skip(f"{features} is not built (set HAPI_BUILD_ROOT)")
    r = subprocess.run([PYTHON, str(SOAK), "--seconds", "30"], capture_output=True, text=True,
                       timeout=900, env=dict(os.environ, HAPI_BUILD_ROOT=str(BUILD_ROOT)))
    out = r.stdout + r.stderr
    print(out)  # all of it, in the report of a failure
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert last.startswith("soak: {"), "no summary: see the captured output"
    res = json.loads(last[len("soak: "):])
    assert r.returncode == 0, "the soak failed: see the captured output"
    assert res["wrong"] == 0 and res["unexpected_errors"] == 0
    assert res["daemon_alive"] and res["unmounted"]
    assert res["seconds"] >= 30 and res["readers"] == 64
    # it read, and checked what it read
    assert res["feat_reads"] > 1000 and res["pack_reads"] > 20
    assert res["features_checked"] > 1000 and res["bytes_checked"] > 0
    # everything changed, more than once
    for k in ("split_changes", "evict_all", "evict_path", "warm_starts", "modified", "replaced",
              "deleted", "added"):
        assert res[k] >= 2, (k, res[k])
    assert res["cache_evictions"] > 0  # the cache is small enough to evict all the time
    # the daemon's memory and descriptors were sampled
    assert res["rss_kb"]["max"] >= res["rss_kb"]["min"] > 0
    assert res["fds"]["max"] >= res["fds"]["min"] > 0
