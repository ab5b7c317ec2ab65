"""The policy on real mounts: split=auto explained, the profile stored, live split and batch changes, injected OOM, hapifs-ctl."""
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import HAPIFS, PYTHON, SOURCE_ROOT, reference_features
from test_ctl import ctl
from test_throughput import make_tree, read_concurrently


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    return src, make_tree(src, classes=2, per_class=8, size=(64, 80))


def test_split_auto_is_explained_and_the_profile_stored(tree, mounter, models, tmp_path):
    src, names = tree
    cache = tmp_path / "cache"
    m = mounter(src, model=models(), cache=str(cache), own_profile=True)
    config = m.ctl("config")
    freeze = config["split"]["freeze"]
    policy = m.ctl("policy")
    assert policy["state"] == "ready"
    cands = policy["candidates"]
    assert [c["split"] for c in cands] == list(range(1, freeze + 1))  # never past freeze
    chosen = [c for c in cands if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["split"] == policy["choice"]["split"]
    # the mount serves what the policy chose, and says so
    assert config["split"]["index"] == policy["choice"]["split"] == policy["current"]["split"]
    assert config["split"]["by"] == "policy"
    assert policy["why"] and chosen[0]["stage"] in policy["why"]
    for c in cands:
        assert c["cold_epoch_s"] > 0 and c["warm_epoch_s"] <= c["cold_epoch_s"] + 1e-12
        assert c["total_s"] == pytest.approx(c["cold_epoch_s"] + 4 * c["warm_epoch_s"])
        assert c["cold_bound"] in ("storage", "link", "compute")
    # the winner has the least total among those that fit
    assert chosen[0]["total_s"] <= min(c["total_s"] for c in cands) * 1.006
    assert policy["raw"]["file_bytes"] > 0
    # a .feat is the chosen split's shape
    arr = np.load(m.path / (names[0] + ".feat"))
    assert list(arr.shape) == config["split"]["shape"]

    profile = m.ctl("profile")
    assert profile["state"] == "measured"
    assert [s["name"] for s in profile["stages"]] == [s["name"] for s in config["model"]["stages"]]
    for s in profile["stages"]:
        assert len(s["ms_per_sample"]) == len(profile["batches"]) and min(s["ms_per_sample"]) > 0
        assert s["bytes_fp16"] * 2 == s["bytes_fp32"]
    assert profile["decode_samples"] > 0 and profile["decode_ms"] > 0
    stored = list(cache.glob("profile-*.json"))
    assert len(stored) == 1
    # timing depends on the BLAS (Debian's libblas.so.3 alternative): the profile names it
    blas = os.path.basename(os.path.dirname(os.path.realpath(
        "/usr/lib/x86_64-linux-gnu/libblas.so.3")))
    blas = "reference" if blas == "blas" else blas
    assert config["runtime"]["blas"] == blas
    assert f"-cpu-{blas}-t" in stored[0].name
    # a remount reads it instead of profiling again; profile=redo measures again
    m.unmount()
    again = mounter(src, model=models(), cache=str(cache))
    again.ctl("config")  # waits for the policy
    assert again.ctl("profile")["state"] == "stored"
    assert "profile read from" in again.log_text()
    again.unmount()
    redo = mounter(src, model=models(), cache=str(cache), profile="redo")
    redo.ctl("config")
    assert redo.ctl("profile")["state"] == "measured"
    redo.unmount()
    # another BLAS (the reference one, chosen for this daemon alone) is measured again
    ref = "/usr/lib/x86_64-linux-gnu/blas"
    if blas != "reference" and os.path.exists(ref + "/libblas.so.3"):
        os.environ["LD_LIBRARY_PATH"] = ref
        try:
            other = mounter(src, model=models(), cache=str(cache))
        finally:
            del os.environ["LD_LIBRARY_PATH"]
        other.ctl("config")
        assert other.ctl("config")["runtime"]["blas"] == "reference"
        assert other.ctl("profile")["state"] == "measured"
        assert len(list(cache.glob("profile-*-cpu-reference-t*.json"))) == 1
        assert len(list(cache.glob("profile-*.json"))) == 2


def test_the_link_moves_the_split(tree, mounter, models):
    src, _ = tree
    # a slow link: the smallest features win, the pooling layer
    slow = mounter(src, model=models(), link="1Mbit")
    freeze = slow.ctl("config")["split"]["freeze"]
    assert slow.ctl("config")["split"]["index"] == freeze
    slow.unmount()
    # a fast link, a far faster compute tier, one epoch: leave the work to the compute tier,
    # short of the earliest splits, whose bytes cost its CPU to receive (compute_byte_ns)
    fast = mounter(src, model=models(), link="1000Gbit", client_speed=1000, epochs=1,
                   link_bytes="any")
    policy = fast.ctl("policy")
    choice = policy["choice"]["split"]
    assert choice < freeze - 1, policy["why"]
    assert fast.ctl("config")["split"]["index"] == choice
    cands = {c["split"]: c for c in policy["candidates"]}
    assert cands[choice]["total_s"] < cands[freeze]["total_s"]
    assert policy["inputs"]["link"] == "1 Tbit/s"


def test_set_split_changes_sizes_and_contents(tree, mounter, models):
    src, names = tree
    archive = models()
    m = mounter(src, model=archive, dtype="fp32", split="pool")
    f = m.path / (names[0] + ".feat")
    old_size = f.stat().st_size
    held = open(f, "rb")  # opened at the pooling split
    r = ctl("set-split", "layer2", m.path)
    assert r.returncode == 0, r.stderr
    assert "layer2" in r.stdout
    config = m.ctl("config")
    assert config["split"]["stage"] == "layer2" and config["split"]["by"] == "operator"
    assert config["split"]["stages_after"] == [3, config["split"]["freeze"]]
    new_size = f.stat().st_size
    assert new_size == config["split"]["feat_size"] != old_size
    # (not names[0]: the kernel's page cache is per file, and the held one must not be reopened)
    for name in names[1:5]:
        arr = np.load(m.path / (name + ".feat"))
        ref = reference_features(archive, src / name, 3)
        assert arr.shape == ref.shape
        np.testing.assert_allclose(arr, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # the file opened before, and not opened again since, keeps its shape to the end
    old = np.load(held)
    held.close()
    assert old.shape == tuple(reference_features(archive, src / names[0], 6).shape)
    # back to auto: the policy's split again
    r = ctl("--json", "set-split", "auto", m.path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["split"]["by"] == "policy"
    assert out["split"]["index"] == m.ctl("policy")["choice"]["split"]
    assert m.ctl("stats")["split_changes"] >= 1


def test_bad_control_input_keeps_the_settings(tree, mounter, models):
    src, _ = tree
    m = mounter(src, model=models(), split="layer4", batch=4)
    before = m.ctl("config")
    cases = [
        (["set-split", "layer9"], "not a stage"),
        (["set-split", "99"], "not a stage"),
        (["set-split", "fc"], "past the freeze"),
        (["set-link", "100"], "no unit"),
        (["set-link", "100mbps"], "ambiguous"),
        (["set-batch", "0"], "usage: batch"),
        (["set-batch", "many"], "usage: batch"),
    ]
    for args, why in cases:
        r = ctl(*args, m.path)
        assert r.returncode == 3, (args, r.stdout, r.stderr)
        assert why in r.stderr, (args, r.stderr)
        assert r.stderr.count("\n") == 1
    # a malformed control line, straight to the file
    for line in ["split", "split a b", "link", "epochs 1.5", "client_speed -2"]:
        with pytest.raises(OSError) as e:
            with open(m.path / ".hapifs" / "ctl", "w") as f:
                f.write(line + "\n")
        assert e.value.errno == 22, line
    after = m.ctl("config")
    assert after["split"] == before["split"]
    assert after["runtime"]["batch"] == 4 and after["policy"] == before["policy"]
    errors = m.ctl("errors")["errors"]
    assert any(e["path"] == ".hapifs/ctl" and "freeze" in e["error"] for e in errors)


def test_hapifs_ctl_profile_policy_and_set(tree, mounter, models):
    src, _ = tree
    m = mounter(src, model=models())
    m.ctl("config")
    r = ctl("profile", m.path)
    assert r.returncode == 0, r.stderr
    assert "stem" in r.stdout and "ms@b1" in r.stdout
    r = ctl("--json", "profile", m.path)
    assert json.loads(r.stdout)["stages"][0]["name"] == "stem"
    r = ctl("policy", m.path)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("* ")]
    assert len(lines) == 2  # the winner's row and the reason
    # the terms, and how a first epoch read file by file combines them
    assert "\nterms of split " in r.stdout and "a first epoch takes the 3-norm" in r.stdout
    assert "a first epoch takes the 3-norm of its tiers (shuffled" in r.stdout  # nothing read
    for f in sorted(m.path.rglob("*.feat")):  # every feature of the split served, cached
        f.read_bytes()
    chosen = [c for c in m.ctl("policy")["candidates"] if c["chosen"]][0]
    assert chosen["cached"] == 1, chosen
    r = ctl("policy", m.path)
    assert "every feature is cached" in r.stdout and "3-norm" not in r.stdout, r.stdout
    r = ctl("--json", "policy", m.path)
    assert json.loads(r.stdout)["candidates"]
    r = ctl("set-link", "100Mbit", m.path)
    assert r.returncode == 0 and "100 Mbit/s" in r.stdout, r.stderr
    assert m.ctl("policy")["inputs"]["link_bps"] == 100e6
    r = ctl("--json", "set-batch", "3", m.path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["batch"] == 3
    assert m.ctl("stats")["batcher"]["batch"] == 3
    r = ctl("--json", "set-batch", "auto", m.path)
    assert json.loads(r.stdout)["batch"] == m.ctl("policy")["choice"]["batch"]
    assert ctl("set-split", "layer3", "/").returncode == 2  # not a mount
    assert ctl("set-split", m.path).returncode == 2  # the mount taken for the value: no mount "."
    assert ctl("set-split").returncode == 1


def test_probe_speed_stages_reach_the_policy(tree, mounter, models):
    """probe-speed measures the compute side's stages at the training batch; hapifs-ctl
    set-compute-stages hands them to the policy, which charges them instead of the profile's."""
    src, _ = tree
    m = mounter(src, model=models(), epochs=2)
    freeze = m.ctl("config")["split"]["freeze"]
    probe = [PYTHON, str(SOURCE_ROOT / "examples" / "probe-speed.py"), str(m.path),
             "--seconds", "0.1", "--threads", "1"]
    r = subprocess.run(probe + ["--batch", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    last = r.stdout.splitlines()[-3:]
    assert last[0].startswith("client_speed ") and last[1].startswith("compute_stages "), last
    assert last[2].startswith("compute_file_ms "), last
    # another process on the node, busy a fifth of the time: the loop's figure is not its
    busy = subprocess.Popen([PYTHON, "-c", "import time\nwhile True:\n t = time.monotonic()\n"
                             " while time.monotonic() - t < 0.01: pass\n time.sleep(0.04)"])
    try:
        r = subprocess.run(probe + ["--batch", "3", "--json"], capture_output=True, text=True,
                           timeout=300)
    finally:
        busy.kill()
        busy.wait()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    stages = out["compute_stages_ms"]
    assert out["train_batch"] == 3 and len(stages) == freeze and min(stages) > 0
    assert out["client_speed"] > 0 and out["batch"] == m.ctl("profile")["batches"][-1]
    # the training loop per file: every file of the tree read, two passes at least, on the
    # CPUs this process may use; the bytes the policy charges apart taken out
    loop = out["loop"]
    assert loop["files"] == 16 and loop["passes"] >= 2 and loop["split"] == \
        m.ctl("config")["split"]["index"], loop
    assert loop["files_read"] >= 2 * 12 and loop["cpus"] == sorted(os.sched_getaffinity(0))
    assert loop["policy_inputs"] and loop["compute_load_ns"] > 0, loop
    # the CPUs' work at rest (the busy process above) measured and taken out at its rate
    assert loop["rest_s"] == 3 and loop["rest_cpus"] >= 0.1, loop
    assert loop["rest_cpu_s"] == pytest.approx(loop["rest_cpus"] * loop["seconds"]), loop
    assert loop["cpu_ms_per_file"] == pytest.approx(
        1e3 * (loop["cpu_s"] - loop["rest_cpu_s"] - loop["trunk_cpu_s"]) / loop["files_read"])
    assert loop["storage_left"] == 0 and loop["settle_s"] >= 0, loop  # measured beside no work
    # train.py's workers start anew every epoch: measured apart, spread over the tree's samples;
    # never below what starting them costs this process alone (a difference of two noisy
    # figures was once -0.0006 s)
    assert loop["samples"] == 16 and loop["epoch_start_floor_s"] > 0, loop
    assert loop["epoch_start_s"] >= loop["epoch_start_floor_s"], loop
    assert loop["start_ms_per_file"] == pytest.approx(1e3 * loop["epoch_start_s"] / 16)
    assert 0 < out["compute_file_ms"] == loop["compute_file_ms"] == pytest.approx(
        loop["cpu_ms_per_file"] - loop["file_bytes"] * loop["compute_load_ns"] / 1e6
        - loop["received_bytes_per_file"] * loop["compute_byte_ns"] / 1e6
        + loop["start_ms_per_file"]), loop
    assert (loop["trunk_cpu_s"] > 0) == (loop["split"] < freeze), loop
    # as printed, to the storage side's mount
    line = ",".join(f"{ms:.4g}" for ms in stages)
    r = ctl("set-compute-stages", line, m.path)
    assert r.returncode == 0 and "compute stages measured" in r.stdout, (r.stdout, r.stderr)
    given = [float(v) for v in line.split(",")]
    assert m.ctl("config")["policy"]["compute_stages_ms"] == pytest.approx(given)
    policy = m.ctl("policy")
    assert policy["inputs"]["compute_stages_ms"] == pytest.approx(given)
    for c in policy["candidates"]:
        assert c["compute_ms"] == pytest.approx(sum(given[c["split"]:freeze]), abs=1e-9), c
    r = ctl("policy", m.path)
    assert "as measured on the compute tier (compute_stages)" in r.stdout, r.stdout
    status = ctl("status", m.path).stdout
    assert f"its stages measured there ({len(given)})" in status, status
    # refused whole: nothing changes
    for bad in ["1,x", "-1", "1,,2", "1;2", ",".join(["1"] * 65)]:
        with pytest.raises(OSError) as e:
            with open(m.path / ".hapifs" / "ctl", "w") as f:
                f.write(f"compute_stages {bad}\n")
        assert e.value.errno == 22, bad
    assert m.ctl("policy")["inputs"]["compute_stages_ms"] == pytest.approx(given)
    # none: the profile over client_speed again
    assert ctl("set-compute-stages", "none", m.path).returncode == 0
    policy = m.ctl("policy")
    assert policy["inputs"]["compute_stages_ms"] == []
    speed = policy["inputs"]["client_speed"]
    profile = m.ctl("profile")
    for c in policy["candidates"]:
        tail = sum(s["ms_per_sample"][-1] for s in profile["stages"][c["split"]:freeze])
        assert c["compute_ms"] == pytest.approx(tail / speed, rel=1e-6), c
    assert "(client_speed)" in ctl("policy", m.path).stdout
    status = ctl("status", m.path).stdout
    assert "this node (client_speed)" in status and "measured there" not in status, status


def test_probe_speed_takes_the_trunk_out_of_the_loop(tree, mounter, models):
    """At a split before the freeze point the loop runs the mount's trunk [split, freeze), as
    train.py does; its CPU is the trunk's, not the loop's."""
    src, _ = tree
    m = mounter(src, model=models(), split="layer3")
    config = m.ctl("config")["split"]
    assert config["index"] < config["freeze"]
    r = subprocess.run([PYTHON, str(SOURCE_ROOT / "examples" / "probe-speed.py"), str(m.path),
                        "--seconds", "0.2", "--threads", "1", "--batch", "4", "--files", "12"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("compute_file_ms ") and float(lines[-1].split()[1]) >= 0
    loop = [ln for ln in lines if ln.startswith("the training loop at split ")]
    assert len(loop) == 1 and f"at split {config['index']}:" in loop[0], lines
    words = loop[0].split()
    read, passes = int(words[6]), int(words[10])
    assert passes >= 2 and read >= 2 * 8 and "passes over 12 " in loop[0], loop
    assert float(loop[0].split("beside the trunk's ")[1].rstrip(";")) > 0, loop


def test_link_bytes_keeps_splits_larger_than_the_images_out(tree, mounter, models):
    """link_bytes=: by default no split whose .feat outweighs the images wins; any lifts the
    bound, live; the candidates over it are marked, and why says what the bound cost."""
    src, _ = tree
    # the setting that picks an early split without a bound (test_the_link_moves_the_split)
    m = mounter(src, model=models(), link="1000Gbit", client_speed=1000, epochs=1)
    assert m.ctl("config")["policy"]["link_bytes"] == 1  # waits for the first split
    policy = m.ctl("policy")
    source = policy["inputs"]["source_bytes"]
    assert source > 0 and policy["inputs"]["link_bytes"] == 1
    for c in policy["candidates"]:
        assert c["within_link_bytes"] == (c["file_bytes"] <= source), c
    within = [c for c in policy["candidates"] if c["within_link_bytes"]]
    assert within, policy["candidates"]  # the pooled features are smaller than a 64x80 image
    chosen = next(c for c in policy["candidates"] if c["chosen"])
    assert chosen["within_link_bytes"]
    assert chosen["total_s"] == min(c["total_s"] for c in within)
    fastest = min(policy["candidates"], key=lambda c: c["total_s"])
    assert not fastest["within_link_bytes"], policy["candidates"]
    assert f"{fastest['stage']} would take" in policy["why"], policy["why"]
    assert "over link_bytes=1" in policy["why"], policy["why"]
    text = ctl("policy", m.path).stdout
    assert "(over link_bytes)" in text and "at most 1x a source image's bytes" in text, text
    # any: the least time wins; split auto serves it
    r = ctl("set-link-bytes", "any", m.path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    policy = m.ctl("policy")
    assert policy["inputs"]["link_bytes"] == 0
    assert all(c["within_link_bytes"] for c in policy["candidates"])
    free = next(c for c in policy["candidates"] if c["chosen"])
    # the least time, or within half a percent of it with fewer bytes (the policy's ties)
    assert free["total_s"] <= fastest["total_s"] * 1.005, policy["why"]
    assert free["file_bytes"] > source, policy["why"]
    (m.path / ".hapifs" / "ctl").write_text("split auto\n")
    assert m.ctl("config")["split"]["index"] == free["split"]
    # refused whole, nothing changes
    for bad in ["0", "-1", "x", "1001", "nan", ""]:
        with pytest.raises(OSError) as e:
            with open(m.path / ".hapifs" / "ctl", "w") as f:
                f.write(f"link_bytes {bad}\n")
        assert e.value.errno == 22, bad
    assert m.ctl("policy")["inputs"]["link_bytes"] == 0
    (m.path / ".hapifs" / "ctl").write_text("link_bytes 1\n")
    assert m.ctl("policy")["choice"]["split"] == chosen["split"]


def test_compute_file_ms_reaches_the_policy(tree, mounter, models, tmp_path):
    """The compute tier's loop per file: a mount option, a control command (hapifs-ctl
    set-compute-file-ms), back to the default; the policy charges it to every reader."""
    src, _ = tree
    m = mounter(src, model=models(), compute_file_ms="0.7")
    assert m.ctl("config")["policy"]["compute_file_ms"] == pytest.approx(0.7)
    assert m.ctl("config")["policy"]["compute_file_ms_given"] is True
    before = m.ctl("policy")
    assert before["inputs"]["compute_file_ms"] == pytest.approx(0.7)
    assert "(measured there)" in ctl("status", m.path).stdout
    assert "0.700 ms of the training loop" in ctl("policy", m.path).stdout
    r = ctl("set-compute-file-ms", "2.2", m.path)
    assert r.returncode == 0 and "compute_file_ms 2.2" in r.stdout, (r.stdout, r.stderr)
    after = m.ctl("policy")
    assert after["inputs"]["compute_file_ms"] == pytest.approx(2.2)
    for b, a in zip(before["candidates"], after["candidates"]):
        assert a["reader_ms"] - b["reader_ms"] == pytest.approx(1.5), (b, a)
    # refused whole: nothing changes
    for bad in ["-1", "x", "1e7", "nan", ""]:
        with pytest.raises(OSError) as e:
            with open(m.path / ".hapifs" / "ctl", "w") as f:
                f.write(f"compute_file_ms {bad}\n")
        assert e.value.errno == 22, bad
    assert m.ctl("policy")["inputs"]["compute_file_ms"] == pytest.approx(2.2)
    # default: the policy's constant, said to be one
    r = ctl("set-compute-file-ms", "default", m.path)
    assert r.returncode == 0 and "(default)" in r.stdout, r.stdout
    config = m.ctl("config")["policy"]
    assert config["compute_file_ms_given"] is False and config["compute_file_ms"] > 0
    assert m.ctl("policy")["inputs"]["compute_file_ms"] == config["compute_file_ms"]
    assert "(the default)" in ctl("status", m.path).stdout
    assert "a default: probe-speed.py measures it" in ctl("policy", m.path).stdout


def test_injected_oom_halves_the_batch_and_every_read_succeeds(tree, mounter, models,
                                                               monkeypatch):
    src, names = tree
    archive = models()
    ref = mounter(src, model=archive, split="pool", cache=str(src.parent / "refcache"))
    want = {n: (ref.path / (n + ".feat")).read_bytes() for n in names}
    # an inference of more than 2 samples fails as libtorch's would when out of memory
    monkeypatch.setenv("HAPIFS_FAULT_OOM_ABOVE", "2")
    m = mounter(src, model=archive, split="pool", batch=8, batch_wait=50)
    got = read_concurrently(m, [n + ".feat" for n in names], readers=16)
    assert {n[:-5]: v for n, v in got.items()} == want
    b = m.ctl("stats")["batcher"]
    assert b["oom_splits"] >= 1, b
    assert b["batch"] <= 2, b  # the next batches use the smaller size
    assert b["failed"] == 0 and m.ctl("stats")["feat"]["failed"] == 0
    assert "out of memory" not in json.dumps(m.ctl("errors"))


@pytest.mark.parametrize("opt,why", [
    ("link=100", "no unit"),
    ("link=fast", "link rate"),
    ("client_speed=0", "client_speed"),
    ("link_bytes=0", "link_bytes"),
    ("link_bytes=none", "link_bytes"),
    ("compute_file_ms=-1", "compute_file_ms"),
    ("epochs=0", "epochs"),
    ("profile=again", "profile"),
    ("batch=0", "batch"),
])
def test_bad_policy_options_fail_the_mount(tree, models, tmp_path, opt, why):
    src, _ = tree
    mp = tmp_path / "mnt"
    mp.mkdir()
    r = subprocess.run([str(HAPIFS), str(src), str(mp), "-o",
                        f"model={models()},cache={tmp_path / 'c'},{opt}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert why in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not os.path.ismount(mp)


def test_round_trips_and_packs_in_the_policy(tree, mounter, models):
    """rtt= and transport= reach the policy; it shows both transports and chooses by one."""
    src, _ = tree
    m = mounter(src, model=models(), rtt="1ms", transport="pack", link="1Gbit")
    assert m.ctl("config")["policy"]["transport"] == "pack"  # waits for the first split
    policy = m.ctl("policy")
    assert policy["inputs"]["rtt_ms"] == pytest.approx(1.0)
    assert policy["inputs"]["transport"] == "pack"
    for c in policy["candidates"]:
        assert c["total_s"] == pytest.approx(c["total_pack_s"])
        assert c["link_pack_ms"] < c["link_file_ms"]  # 4 round trips of 1 ms over 8 readers
        assert c["link_file_ms"] >= 0.5
    assert m.ctl("config")["policy"]["transport"] == "pack"
    (m.path / ".hapifs" / "ctl").write_text("transport file\nrtt 0\n")
    policy = m.ctl("policy")
    assert policy["inputs"]["transport"] == "file" and policy["inputs"]["rtt_ms"] == 0
    for c in policy["candidates"]:
        assert c["total_s"] == pytest.approx(c["total_file_s"])
    with pytest.raises(OSError):
        with open(m.path / ".hapifs" / "ctl", "w") as f:
            f.write("transport carrier-pigeon\n")
