"""The mounts of one node share a memory budget and the cores through a node file (node=):
joined at mount, shown in .hapifs/stats, taken back from a daemon that was killed."""
import os
import signal
import subprocess
import threading

import pytest

from conftest import BUILD_ROOT, HAPIFS, need_hapifs, wait_gone
from test_throughput import make_tree


def node_stats(m):
    return m.ctl("stats")["node"]


def read_all(root, paths):
    return {p: (root / (p + ".feat")).read_bytes() for p in paths}


def test_mounts_share_the_node_file(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=2, per_class=10, size=(64, 80))
    node = tmp_path / "run" / "node"
    opts = dict(model=str(models()), node=str(node), node_mem="2G", node_cores="2",
                prefetch="off")
    a = mounter(src, cache=str(tmp_path / "ca"), **opts)
    b = mounter(src, cache=str(tmp_path / "cb"), model=str(models()), node=str(node),
                prefetch="off")  # no node_mem: keeps the file's
    st = node_stats(b)
    assert st["file"] == str(node)
    assert st["mounts"] == 2
    assert st["mem_total"] == 2 << 30
    assert st["cores"] == 2
    assert oct(os.stat(node).st_mode & 0o777) == "0o644"
    # both compute at once, taking turns for the cores; the same features as either alone
    out = {}
    ts = [threading.Thread(target=lambda m=m: out.__setitem__(m, read_all(m.path, paths)))
          for m in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out[a].keys() == out[b].keys() == set(paths)
    sa, sb = node_stats(a), node_stats(b)
    # each holds its model's share (weights and working memory from the profile), nothing
    # in flight once the reads are done, and no core
    assert sa["own_fixed"] > 10 << 20 and sb["own_fixed"] > 10 << 20
    assert sa["own_flight"] == sb["own_flight"] == 0
    assert sa["cores_used"] == 0 and sa["waiting"] == 0
    assert sa["mem_used"] == sa["own_fixed"] + sb["own_fixed"]
    assert a.ctl("stats")["batcher"]["samples"] == len(paths)
    status = subprocess.run([str(BUILD_ROOT / "tools" / "hapifs-ctl"), "status", str(a.path)],
                            capture_output=True, text=True, check=True).stdout
    line = next(l for l in status.splitlines() if l.startswith("node"))
    assert "2 mounts hold" in line and "of 2.0 GiB" in line and "cores 0 of 2 busy" in line, line


def test_a_killed_daemons_share_is_taken_back(tmp_path, models, mounter):
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=4, size=(64, 80))
    node = tmp_path / "node"
    opts = dict(model=str(models()), node=str(node), prefetch="off")
    a = mounter(src, cache=str(tmp_path / "ca"), **opts)
    b = mounter(src, cache=str(tmp_path / "cb"), **opts)
    assert node_stats(a)["mounts"] == 2
    os.kill(b.pid, signal.SIGKILL)
    assert wait_gone(b.pid)
    subprocess.run(["fusermount3", "-u", "-z", str(b.path)], check=False)
    c = mounter(src, cache=str(tmp_path / "cc"), **opts)  # joining takes back the dead slot
    st = node_stats(a)
    assert st["mounts"] == 2
    assert st["reaped"] == 1
    assert node_stats(c)["mem_used"] == st["mem_used"]


@pytest.mark.parametrize("opt, message", [
    ("node=run/node", "node=run/node: expected an absolute path or none"),
    ("node_mem=0", "node_mem=0: expected a size"),
    ("node_cores=0", "node_cores=0: expected 1..4096"),
    ("node=/proc/self/hapifs-node", "node=/proc/self/hapifs-node"),
])
def test_node_options_are_checked(tmp_path, models, opt, message):
    need_hapifs()
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=1, size=(64, 80))
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([str(HAPIFS), str(src), str(tmp_path / "mnt"), "-o",
                        f"model={models()},cache={tmp_path / 'c'},{opt}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert message in r.stderr
