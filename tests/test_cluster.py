"""bench/hapifs-cluster: storage nodes and a compute node in network namespaces, for real.

Each test brings a cluster up with its own prefix and state dir over a few tens of tiny images,
and the fixture always takes it down and checks that nothing is left: no namespace, no mount, no
daemon, no state dir.
"""
import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import HAPIFS, PYTHON, SOURCE_ROOT, daemon_pid, npy_bytes, wait_gone

CLUSTER = SOURCE_ROOT / "bench" / "hapifs-cluster"
_serial = itertools.count()


def _hapifs_binary():
    if HAPIFS.exists():
        return HAPIFS
    found = shutil.which("hapifs")
    return Path(found) if found else None


def need_cluster():
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("the cluster needs root and /dev/fuse")
    if _hapifs_binary() is None:
        pytest.skip(f"no hapifs binary: {HAPIFS} is not built and hapifs is not on PATH")
    for tool in ["sshfs", "mergerfs", "ssh", "ssh-keygen", "nsenter", "ip", "tc", "fusermount3"]:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing (tools/install-deps installs it)")
    if not os.access("/usr/sbin/sshd", os.X_OK):
        pytest.skip("/usr/sbin/sshd is missing (tools/install-deps installs openssh-server)")
    probe = f"hctprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], check=False)


def need_tiers():
    """need_cluster(), and a CPU for each tier (hapifs-cluster --storage-cpus/--compute-cpus)."""
    need_cluster()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the tiers need a CPU each")


def make_dataset(root, classes=4, per_class=6, seed=0):
    """Class folders of small JPEGs (and a PNG each) of assorted sizes; returns relative paths."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    made = []
    for c in range(classes):
        d = Path(root) / f"class{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(64, 113, 2))
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8))
            name = f"img{i}.png" if i == 0 else f"img{i}.jpg"
            img.save(d / name)
            made.append(f"class{c}/{name}")
    return sorted(made)


def walk(root):
    out = []
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def mounts_under(path):
    path = str(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == path or p.startswith(path + "/")]


def namespaces(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def processes_using(path):
    """Live processes with an argument below path (hapifs, sshd, sshfs, ssh, mergerfs), or run
    from there (the delay relays)."""
    want = str(path) + "/"
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if (d / "stat").read_text().split()[2] == "Z":
                continue
        except OSError:
            continue
        if any(a.decode(errors="replace").startswith(want) for a in argv):
            found.append(int(d.name))
    return found


class Cluster:
    def __init__(self, tmp_path):
        self.prefix = f"hct{os.getpid() % 10000}x{next(_serial)}"
        self.state = tmp_path / f"state-{self.prefix}"
        self.pids = set()

    def cli(self, command, *args, timeout=120):
        return subprocess.run([str(CLUSTER), command, *map(str, args)], capture_output=True,
                              text=True, timeout=timeout)

    def up(self, data, model, *args, check=True):
        r = self.cli("up", "-q", "--data", data, "--model", model, "--state", self.state,
                     "--prefix", self.prefix, "--hapifs", _hapifs_binary(), *args)
        if check:
            assert r.returncode == 0, r.stderr
            self.remember_pids()
        return r

    def remember_pids(self):
        """Every process of the cluster, to check after down that each one is gone."""
        self.pids.update(processes_using(self.state))
        for ns in namespaces(self.prefix):
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            self.pids.update(int(p) for p in out.stdout.split())
        for pidfile in self.state.glob("s*/sshd.pid"):
            self.pids.add(int(pidfile.read_text()))

    def run(self, *cmd):
        return self.cli("run", "--state", self.state, *cmd)

    def down(self):
        return self.cli("down", "--state", self.state, "--prefix", self.prefix)

    def assert_nothing_left(self):
        assert namespaces(self.prefix) == []
        assert mounts_under(self.state) == []
        assert not self.state.exists()
        for pid in self.pids:
            assert wait_gone(pid, timeout=10), f"process {pid} of the cluster still runs"
        assert processes_using(self.state) == []


@pytest.fixture
def cluster(tmp_path):
    """cluster() -> Cluster; each is taken down at the end and must leave nothing behind."""
    need_cluster()
    made = []

    def make():
        c = Cluster(tmp_path)
        made.append(c)
        return c

    yield make
    for c in made:
        r = c.down()
        assert r.returncode == 0, r.stderr
        c.assert_nothing_left()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-data")
    return root, make_dataset(root)


READER = r"""
import hashlib, json, os, sys
root = sys.argv[1]
feats = {}
for d, _, files in os.walk(root):
    for f in files:
        p = os.path.join(d, f)
        with open(p, "rb") as fh:
            data = fh.read()
        feats[os.path.relpath(p, root)] = [len(data), hashlib.sha256(data).hexdigest()]
with open("/proc/net/dev") as f:
    links = sorted(l.split(":")[0].strip() for l in f if l.strip().startswith("to-s"))
print(json.dumps({"feats": feats, "links": links}))
"""


def test_two_nodes_end_to_end(cluster, dataset, models):
    src, images = dataset
    c = cluster()
    r = c.up(src, models(), "--storage", 2, "--link", "100mbit", "--rtt", "2ms")
    root = Path(r.stdout.strip())
    assert root == c.state / "compute" / "union"
    assert (c.state / "root").read_text().strip() == str(root)
    assert c.cli("status", "--state", c.state).returncode == 0

    # read everything from the compute node, as a training script would
    r = c.run(PYTHON, "-c", READER, root)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["links"] == ["to-s1", "to-s2"]  # it ran in the compute namespace
    assert sorted(seen["feats"]) == sorted(p + ".feat" for p in images)
    assert walk(root) == sorted(p + ".feat" for p in images)

    # class folders round-robin in sorted order; every .feat equals the storage node's own
    classes = sorted({p.split("/")[0] for p in images})
    per_node = {1: 0, 2: 0}
    for rel in images:
        node = classes.index(rel.split("/")[0]) % 2 + 1
        other = 3 - node
        direct = (c.state / f"s{node}" / "mnt" / (rel + ".feat")).read_bytes()
        assert not (c.state / f"s{other}" / "mnt" / (rel + ".feat")).exists()
        size, digest = seen["feats"][rel + ".feat"]
        assert (size, digest) == (len(direct), hashlib.sha256(direct).hexdigest()), rel
        assert direct[:6] == b"\x93NUMPY"
        per_node[node] += size

    # the bytes that crossed each link cover at least what was read from that node
    r = c.cli("bytes", "--state", c.state, "--json")
    assert r.returncode == 0, r.stderr
    counted = json.loads(r.stdout)
    for node, size in per_node.items():
        assert counted["nodes"][f"s{node}"]["rx_bytes"] >= size
    assert counted["total"]["rx_bytes"] >= sum(per_node.values())
    lines = c.cli("bytes", "--state", c.state).stdout.split()
    assert lines[0] == "s1" and lines[3] == "s2" and lines[6] == "total"
    assert int(lines[7]) == int(lines[1]) + int(lines[4])

    # the control directory of the first branch is reachable through the union, unlisted
    assert ".hapifs" not in os.listdir(root)
    config = json.loads((root / ".hapifs" / "config").read_text())
    assert config["mountpoint"] == str(c.state / "s1" / "mnt")

    # a class folder's pack and its index pass through sshfs and mergerfs untouched
    for cls in classes:
        direct = c.state / f"s{classes.index(cls) % 2 + 1}" / "mnt" / cls
        through = (root / cls / ".hapifs-pack.npy").read_bytes()
        assert through == (direct / ".hapifs-pack.npy").read_bytes()
        assert json.loads((root / cls / ".hapifs-pack.json").read_text())["entries"] == \
            json.loads((direct / ".hapifs-pack.json").read_text())["entries"]
        rows = np.load(root / cls / ".hapifs-pack.npy", mmap_mode="r")
        assert rows.shape[0] == sum(p.startswith(cls + "/") for p in images)
        first = sorted(p for p in images if p.startswith(cls + "/"))[0]
        assert npy_bytes(np.asarray(rows[0])) == (root / (first + ".feat")).read_bytes()

    # the link is shaped: 4 MB at 100 Mbit/s take at least 0.32 s
    start = time.monotonic()
    r = c.run("ssh", "-F", c.state / "compute" / "ssh_config", "s1", "head -c 4000000 /dev/zero")
    assert r.returncode == 0 and len(r.stdout) == 4000000
    assert time.monotonic() - start >= 0.32
    # and it has its round trip: each lookup of a new name goes across and back
    start = time.monotonic()
    for i in range(20):
        assert not (c.state / "compute" / "s2" / f"absent{i}").exists()
    assert time.monotonic() - start >= 20 * 0.002

    # a second up on the same state dir is refused and leaves the running cluster alone
    r = c.up(src, models(), check=False)
    assert r.returncode != 0 and "in use" in r.stderr
    assert (root / "class0").is_dir()

    r = c.down()
    assert r.returncode == 0, r.stderr
    c.assert_nothing_left()


def test_hash_shards_over_three_nodes(cluster, tmp_path, models):
    src = tmp_path / "data"
    images = make_dataset(src, classes=3, per_class=5, seed=1)
    (src / "labels.csv").write_text("class,label\n")
    (src / "class1" / "notes.txt").write_text("notes\n")
    c = cluster()
    root = Path(c.up(src, models(), "--storage", 3, "--shard", "hash").stdout.strip())

    def node_of(rel):
        h = 0
        for byte in rel.encode():
            h = (h * 31 + byte) % 1000000007
        return h % 3 + 1

    for k in (1, 2, 3):
        shard = c.state / f"s{k}" / "shard"
        mine = sorted(p for p in images if node_of(p) == k)
        assert sorted(p for p in walk(shard) if not p.endswith((".csv", ".txt"))) == mine
        # every node has the whole folder tree and the other files; images are hard links
        assert sorted(os.listdir(shard)) == ["class0", "class1", "class2", "labels.csv"]
        assert (shard / "class1" / "notes.txt").read_text() == "notes\n"
        for p in mine:
            assert (shard / p).stat().st_ino == (src / p).stat().st_ino
    assert walk(root) == sorted([p + ".feat" for p in images] + ["class1/notes.txt",
                                                                  "labels.csv"])
    for p in images:
        direct = (c.state / f"s{node_of(p)}" / "mnt" / (p + ".feat")).read_bytes()
        assert (root / (p + ".feat")).read_bytes() == direct


def test_single_node(cluster, dataset, models):
    src, images = dataset
    c = cluster()
    root = Path(c.up(src, models(), "--link", "1gbit").stdout.strip())
    assert root == c.state / "compute" / "s1"
    assert os.readlink(c.state / "compute" / "union") == "s1"
    # the whole dataset is the shard: no copy is made
    assert not (c.state / "s1" / "shard").exists()
    assert walk(root) == sorted(p + ".feat" for p in images)
    for p in images[:5]:
        assert (root / (p + ".feat")).read_bytes() == \
            (c.state / "s1" / "mnt" / (p + ".feat")).read_bytes()
    config = json.loads((root / ".hapifs" / "config").read_text())
    assert config["source"] == str(src)
    # run passes the command's exit status through
    assert c.run("sh", "-c", "exit 7").returncode == 7


def test_failed_up_leaves_nothing(cluster, dataset, models, tmp_path):
    src, _ = dataset
    bad = tmp_path / "bad.pt"
    bad.write_text("not a model")
    # fails at the first hapifs mount, after the namespaces, links and shards
    c = cluster()
    r = c.up(src, bad, "--storage", 2, "--link", "1gbit", check=False)
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and "hapifs" in r.stderr, r.stderr
    c.assert_nothing_left()
    # fails at the sshfs mount, with the hapifs mounts and the sshds running
    c = cluster()
    r = c.up(src, models(), "--storage", 2, "--rtt", "1ms", "--sshfs-opts", "no_such_option=1",
             check=False)
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and "sshfs" in r.stderr, r.stderr
    c.assert_nothing_left()
    # refused before anything is made
    c = cluster()
    r = c.up(src, models(), "--storage", 0, check=False)
    assert r.returncode != 0 and "--storage" in r.stderr
    c.assert_nothing_left()


def test_down_after_daemons_died(cluster, dataset, models):
    src, images = dataset
    c = cluster()
    root = Path(c.up(src, models(), "--storage", 2, "--rtt", "1ms").stdout.strip())
    assert (root / (images[0] + ".feat")).read_bytes()[:6] == b"\x93NUMPY"
    # kill the sshd of s1, the hapifs of s2 and the sshfs of s1 half way through
    os.kill(int((c.state / "s1" / "sshd.pid").read_text()), signal.SIGKILL)
    os.kill(daemon_pid(c.state / "s2" / "mnt"), signal.SIGKILL)
    for pid in processes_using(c.state):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if os.path.basename(argv[0]) == b"sshfs" and str(c.state / "compute" / "s1").encode() in argv:
            os.kill(pid, signal.SIGKILL)
    assert c.cli("status", "--state", c.state).returncode == 1
    r = c.down()
    assert r.returncode == 0, r.stderr
    c.assert_nothing_left()


def test_down_is_idempotent_and_careful(cluster, tmp_path):
    c = cluster()
    for _ in range(2):
        r = c.down()
        assert r.returncode == 0, r.stderr
    c.assert_nothing_left()
    # a directory that is not a cluster's state dir is not removed
    other = tmp_path / "not-a-state-dir"
    other.mkdir()
    (other / "keep").write_text("x")
    r = c.cli("down", "--state", other, "--prefix", c.prefix)
    assert r.returncode == 0
    assert (other / "keep").read_text() == "x"
    assert c.cli("status", "--state", c.state, "--prefix", c.prefix).returncode == 3
    for command in ["up", "down", "run", "bytes", "status"]:
        r = c.cli(command, "--help")
        assert r.returncode == 0 and r.stdout.startswith("usage:"), command


def test_remote_mount_over_two_sshfs_nodes(cluster, tmp_path, models):
    """The compute-side mount over each node's sshfs mount: every .feat equal to its node's,
    each node's packs fetched across its own link, a second job moves no feature bytes."""
    src = tmp_path / "data"
    images = make_dataset(src, classes=2, per_class=8, seed=3)
    c = cluster()
    c.up(src, models(), "--storage", 2, "--shard", "hash", "--link", "100mbit", "--rtt", "1ms")
    sources = f"{c.state / 'compute' / 's1'}:{c.state / 'compute' / 's2'}"
    mnt, cache = tmp_path / "remote", tmp_path / "rcache"
    mnt.mkdir()
    cache.mkdir()

    def mount():
        r = subprocess.run([str(_hapifs_binary()), sources, str(mnt), "-o",
                            f"remote,features=split,cache={cache},refresh=0,"
                            f"log={tmp_path / 'remote.log'}"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr

    def link_rx():
        return {k: v["rx_bytes"] for k, v in
                json.loads(c.cli("bytes", "--state", c.state, "--json").stdout)["nodes"].items()}

    mount()
    try:
        before = link_rx()
        assert walk(mnt) == sorted(p + ".feat" for p in images)
        got = {p: (mnt / (p + ".feat")).read_bytes() for p in images}
        # the storage nodes served packs, not a read per .feat
        for k in (1, 2):
            sst = json.loads((c.state / f"s{k}" / "mnt" / ".hapifs" / "stats").read_text())
            assert sst["feat"]["reads"] == 0 and sst["pack"]["opens"] == 2
        for p in images:
            direct = [c.state / f"s{k}" / "mnt" / (p + ".feat") for k in (1, 2)]
            assert got[p] == next(d for d in direct if d.exists()).read_bytes(), p
        # the indexes changed (pending -> cached) while sshfs (kernel_cache, 600 s attributes)
        # kept their old pages and sizes: read again (refresh=0), they must still parse
        for p in images:
            os.stat(mnt / (p + ".feat"))
        errors = json.loads((mnt / ".hapifs" / "errors").read_text())
        assert errors["count"] == 0, errors
        # an image replaced on a storage node: the next read serves its new features, although
        # sshfs keeps the index's old pages (same size, attributes cached for 600 s)
        from PIL import Image
        p = images[0]
        k = next(k for k in (1, 2) if (c.state / f"s{k}" / "shard" / p).exists())
        fresh = c.state / f"s{k}" / "shard" / (p + ".new.jpg")
        Image.fromarray(np.full((80, 90, 3), 30, np.uint8)).save(fresh, quality=90)
        os.replace(fresh, c.state / f"s{k}" / "shard" / p)
        time.sleep(1.5)  # the storage mount's own attribute cache
        want = (c.state / f"s{k}" / "mnt" / (p + ".feat")).read_bytes()
        assert want != got[p]
        assert (mnt / (p + ".feat")).read_bytes() == want
        got[p] = want
        stats = json.loads((mnt / ".hapifs" / "stats").read_text())
        srcs = stats["remote"]["sources"]
        assert [s["state"] for s in srcs] == ["ok", "ok"]
        after = link_rx()
        for k, s in zip(("s1", "s2"), srcs):
            assert s["packs"] >= 2  # both class folders on both nodes (and the changed one)
            assert after[k] - before[k] >= s["pack_bytes"] > 0
        pid = daemon_pid(mnt)
        assert pid, "no hapifs process serves the remote mount"
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
        # the next mount must not start while the old daemon still holds the cache
        assert wait_gone(pid, 30), f"the remote mount's hapifs ({pid}) did not exit"
        mount()
        for p in images:
            (mnt / (p + ".feat")).read_bytes()
        stats = json.loads((mnt / ".hapifs" / "stats").read_text())
        assert stats["remote"]["pack_bytes"] == 0 and stats["feat"]["hits"] == len(images)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        pid = daemon_pid(mnt)
        if pid:
            wait_gone(pid)


TIER_BUSY = r"""
import json, os, time
t0, c0 = time.monotonic(), time.process_time()
while time.monotonic() - t0 < 1.0:
    pass
print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "wall": time.monotonic() - t0,
                  "cpu": time.process_time() - c0}))
"""


def _cgroups(prefix):
    return [p for p in Path("/sys/fs/cgroup").glob(f"*/hapifs-cluster-{prefix}")] + \
        [p for p in Path("/sys/fs/cgroup").glob(f"hapifs-cluster-{prefix}")]


def test_tiers_on_their_own_cpus(cluster, dataset, models):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tiers on their own CPUs need two CPUs")
    src, images = dataset
    c = cluster()
    r = c.up(src, models(), "--storage-cpus", "0", "--compute-cpus", "1",
             "--compute-quota", "0.25", "--storage-quota", "0.5", check=False)
    if r.returncode != 0 and "need cgroups" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr
    c.remember_pids()
    root = Path(r.stdout.strip())
    # the storage node's daemon runs on CPU 0 only, with one torch thread for its one CPU
    pid = daemon_pid(c.state / "s1" / "mnt")
    status = Path(f"/proc/{pid}/status").read_text()
    assert "Cpus_allowed_list:\t0\n" in status
    assert "torch_threads=1" in (c.state / "cluster.conf").read_text()
    # ssh's handshake with a throttled sshd gets 10 s / quota (a 0.1-CPU one took 6-14 s)
    assert "ConnectTimeout 20\n" in (c.state / "compute" / "ssh_config").read_text()
    # a command of `run` is on the compute tier: CPU 1, and a quarter of its time
    r = c.run(PYTHON, "-c", TIER_BUSY)
    assert r.returncode == 0, r.stderr
    busy = json.loads(r.stdout)
    assert busy["cpus"] == [1]
    assert 0.1 < busy["cpu"] / busy["wall"] < 0.4, busy
    # and it still reads the features
    r = c.run(PYTHON, "-c", "import sys; print(open(sys.argv[1], 'rb').read(6)[1:].decode())",
              root / (images[1] + ".feat"))
    assert r.returncode == 0 and r.stdout.strip() == "NUMPY", r.stderr
    st = c.cli("status", "--state", c.state)
    assert "cpus 0 " in st.stdout and "cpus 1 " in st.stdout and "quota 2500 period 10000" in st.stdout
    assert "quota 5000 period 10000" in st.stdout
    assert _cgroups(c.prefix)
    assert c.down().returncode == 0
    assert _cgroups(c.prefix) == []


def test_tiers_refused_cpus_leave_nothing(cluster, dataset, models):
    src, _ = dataset
    c = cluster()
    r = c.up(src, models(), "--storage-cpus", "9999", check=False)
    if "need cgroups" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 1
    assert "cannot have CPUs 9999" in r.stderr
    assert _cgroups(c.prefix) == [] and namespaces(c.prefix) == []
    r = c.up(src, models(), "--compute-quota", "0.01", check=False)
    assert r.returncode == 1 and "less than 1 ms" in r.stderr
