"""bench/soak-tiers for 60 s: 32 readers of a compute-side -o remote mount over two storage nodes
while both tiers fail (a storage daemon killed and restarted, a link down, the compute cache's
disk full, the compute daemon killed and restarted over its dead mount) and the storage side
changes split, evicts, warms, and its images change: every byte checked, none wrong, every error
one the fault of its moment explains, a final pass that reads everything once the faults stop.

The bound on how long a fault's errors may last after it ends is 60 s here, not the tool's
default 10 s: the suite runs beside other tests on 2 cores (a compute restart's errors lasted
19.8 s once under a load of 30), and what this run asserts is that nothing is wrong or lost, that
errors are of the kinds the faults explain, and that everything reads again once they stop; the
recovery times are measured by the 30-minute run (docs/deployment.md).
The compute node's sshfs killed and mounted again is left to that run (53 such faults in 30
minutes, none with an unexpected error), so that this run's six or so faults cover the other
four kinds.
"""
import json
import os
import subprocess

import pytest

from conftest import BUILD_ROOT, PYTHON, SOURCE_ROOT, need_hapifs

SOAK_TIERS = SOURCE_ROOT / "bench" / "soak-tiers"
KINDS = ("storage", "link", "disk", "compute")


def test_soak_tiers_60s(tmp_path):
    need_hapifs()
    features = BUILD_ROOT / "tests" / "hapi-features"
    if not features.exists():
        pytest.skip(f"{features} is not built (set HAPI_BUILD_ROOT)")
    r = subprocess.run([PYTHON, str(SOAK_TIERS), "--seconds", "60", "--faults", ",".join(KINDS),
                        "--recovery", "60", "--seed", "1",
                        "--hapifs", str(BUILD_ROOT / "fusefs" / "hapifs")],
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, HAPI_BUILD_ROOT=str(BUILD_ROOT)))
    out = r.stdout + r.stderr
    print(out)  # all of it, in the report of a failure
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert last.startswith("soak-tiers: {"), "no summary: see the captured output"
    res = json.loads(last[len("soak-tiers: "):])
    assert res["wrong"] == 0 and res["unexpected_errors"] == 0, res["failure_kinds"]
    assert r.returncode == 0, f"the soak failed: {res['failure_kinds']}"
    assert res["daemon_alive"] and res["unmounted"]
    # it read, and checked what it read, through every fault
    assert res["feat_reads"] > 1000 and res["pack_reads"] > 20
    assert res["features_checked"] > 1000 and res["bytes_checked"] > 0
    for kind in KINDS:  # the least-begun kind goes next: the first four faults cover every kind
        assert res["faults"].get(kind, 0) >= 1, (kind, res["faults"])
    for k in ("split_changes", "evict_all", "modified", "replaced", "deleted", "added"):
        assert res[k] >= 1, (k, res[k])
    # the compute cache stayed within its bound; both tiers' memory and descriptors were sampled
    assert res["cache_over_bound_samples"] == 0
    assert res["rss_kb"]["max"] >= res["rss_kb"]["min"] > 0
    for node in res["storage"].values():  # "MIN..MAX"
        low, high = (float(x) for x in node["rss_mb"].split(".."))
        assert high >= low > 0, node
