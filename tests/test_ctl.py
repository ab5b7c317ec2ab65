"""hapifs-ctl against a real mount: status, stats, errors, warm with progress, evict, exit codes."""
import errno
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BUILD_ROOT, EXPORTER, HAPIFS, PYTHON
from test_throughput import make_tree

CTL = BUILD_ROOT / "tools" / "hapifs-ctl"


def ctl(*args, cwd=None, timeout=300):
    if not CTL.exists():
        pytest.skip(f"{CTL} is not built (set HAPI_BUILD_ROOT)")
    return subprocess.run([str(CTL), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    return src, make_tree(src, classes=2, per_class=6, size=(64, 80))


def test_status_and_stats_after_reads(tree, mounter, models):
    src, paths = tree
    m = mounter(src, model=models(), prefetch="off")  # computed counts only what is read
    for p in paths[:5]:
        (m.path / (p + ".feat")).read_bytes()

    r = ctl("--json", "stats", m.path)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["feat"]["computed"] == 5
    assert stats["cache"]["namespace"]["entries"] == 5
    assert stats["feat"]["reads"] >= 5 and stats["feat"]["failed"] == 0
    assert {"feat", "batcher", "warm", "prefetch", "cache"} <= set(stats)

    r = ctl("stats", m.path)
    assert r.returncode == 0, r.stderr
    for section in ("feat:", "batcher:", "warm:", "cache:"):
        assert section in r.stdout.splitlines()

    # run from inside the mount: the mountpoint is found by walking up
    r = ctl("status", cwd=m.path / "class1")
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    config = m.ctl("config")
    assert str(src) in lines["source"]
    assert config["model"]["arch"] in lines["model"]
    # what the features are of: random weights say so; the archive's resize filter
    assert config["model"]["weights"] == "random:seed=0"
    assert config["preprocess"]["interpolation"] == "bilinear"
    assert lines["model"] == f"model      resnet18, fp32 arithmetic  {config['model']['path']}"
    assert lines["weights"] == \
        "weights    random (seed 0): the features describe no trained model"
    assert lines["preprocess"] == ("preprocess exact: bilinear resize 73, crop 64, "
                                   "mean [0.485, 0.456, 0.406], std [0.229, 0.224, 0.225]")
    index = config["split"]["index"]
    assert f"index {index}: stages [0, {index}) of {len(config['model']['stages'])}" in lines["split"]
    assert f"through '{config['split']['stage']}'" in lines["split"]
    assert config["split"]["dtype"] in lines["features"]
    pol = config["policy"]
    assert lines["policy"].split(None, 1)[1] == (
        f"split by {config['split']['by']}; link {pol['link']}, rtt {pol['rtt_ms']:.3g} ms, "
        f"{pol['transport']} transport; compute tier {pol['client_speed']:.3g}x this node "
        f"(client_speed), its loop {pol['compute_file_ms']:.3g} ms a file (the default)"), \
        lines["policy"]
    assert config["cache"]["namespace"][:12] in lines["cache"]
    assert ": 5 entries" in lines["cache"]
    f = m.ctl("stats")["feat"]
    assert lines["reads"].split(None, 1)[1] == (
        f"{f['reads']} (hits {f['hits']}, misses {f['misses']}, computed 5, failed 0)")
    assert lines["prefetch"].startswith("prefetch   off: 0 directories"), lines["prefetch"]
    assert lines["warm"].split()[1] == "idle"

    r = ctl("--json", "config", m.path)
    assert r.returncode == 0 and json.loads(r.stdout)["source"] == str(src)


def test_names_that_are_not_utf8_keep_the_control_files_readable(tmp_path, mounter, models):
    """A cache directory and a warm-up folder whose names are not UTF-8 (Latin-1): config and
    stats stay readable, those names escaped as \\xNN (config was ENOMEM: jansson refuses such
    a string, so a training script could not read its split; a mount point or source of such a
    name the same). Not the mount point itself here: tools that read /proc/mounts as UTF-8 run
    beside this test."""
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=2, size=(40, 56))
    odd = os.fsdecode(b"caf\xe9")  # as Python names bytes that are not UTF-8
    (src / odd).mkdir()
    (src / odd / "a.jpg").write_bytes((src / "class0" / "000.jpg").read_bytes())
    m = mounter(src, model=models(), prefetch="off", cache=str(tmp_path / os.fsdecode(b"c\xe9")))
    config = m.ctl("config")
    assert config["cache"]["dir"].endswith("/c\\xe9"), config["cache"]
    assert config["split"]["index"] >= 1
    fd = os.open(m.path / ".hapifs" / "ctl", os.O_WRONLY)
    try:
        os.write(fd, b"warm caf\xe9")
    finally:
        os.close(fd)
    end = time.monotonic() + 60
    while (warm := m.ctl("stats")["warm"])["state"] != "done":
        assert time.monotonic() < end, warm
        time.sleep(0.1)
    assert warm["path"] == "caf\\xe9" and warm["total"] == 1, warm


def test_status_names_the_weights_and_the_preprocessing(tree, mounter, tmp_path):
    """An archive of a weights file, named by its torchvision enum, resized bicubic, in bf16:
    status says each, as .hapifs/config has them."""
    import torch
    import torchvision
    src, _ = tree
    weights = tmp_path / "r18-finetuned.pth"
    torch.manual_seed(3)
    torch.save({"state_dict": torchvision.models.resnet18().state_dict()}, weights)
    archive = tmp_path / "r18.pt"
    r = subprocess.run([PYTHON, str(EXPORTER), "resnet18", "-o", str(archive), "-q",
                        "--input-size", "32", "--weights", str(weights), "--weights-enum",
                        "ResNet18_Weights.IMAGENET1K_V1", "--interpolation", "bicubic",
                        "--mean", "0.5,0.5,0.5", "--std", "0.25,0.25,0.25"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = mounter(src, model=archive, precision="bf16")
    r = ctl("status", m.path)
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    model = m.ctl("config")["model"]
    assert (model["weights"], model["weights_enum"]) == \
        ("file:r18-finetuned.pth", "ResNet18_Weights.IMAGENET1K_V1")
    assert lines["model"] == f"model      resnet18, bf16 arithmetic  {archive}"
    assert lines["weights"] == "weights    r18-finetuned.pth (ResNet18_Weights.IMAGENET1K_V1)"
    assert lines["preprocess"] == ("preprocess exact: bicubic resize 37, crop 32, "
                                   "mean [0.5, 0.5, 0.5], std [0.25, 0.25, 0.25]")


def test_errors_show_the_corrupt_image(tree, mounter, models):
    src, paths = tree
    m = mounter(src, model=models())
    assert ctl("errors", m.path).stdout.strip() == "no errors"
    (src / "class0" / "broken.jpg").write_bytes(b"not a jpeg at all" * 20)
    with pytest.raises(OSError):
        (m.path / "class0" / "broken.jpg.feat").read_bytes()
    r = ctl("errors", m.path)
    assert r.returncode == 0, r.stderr
    assert "class0/broken.jpg" in r.stdout
    errs = json.loads(ctl("--json", "errors", m.path).stdout)
    assert errs["errors"][-1]["path"] == "class0/broken.jpg"


def test_warm_computes_everything_with_progress(tree, mounter, models):
    src, paths = tree
    m = mounter(src, model=models(), batch=2)
    r = ctl("--json", "warm", m.path)
    assert r.returncode == 0, r.stderr
    warm = json.loads(r.stdout)
    assert warm["state"] == "done"
    assert warm["total"] == len(paths) and warm["done"] == len(paths)
    assert warm["computed"] == len(paths)
    assert "warm [" in r.stderr and f"{len(paths)}/{len(paths)}" in r.stderr
    stats = m.ctl("stats")
    assert stats["warm"]["state"] == "done"
    assert stats["cache"]["namespace"]["entries"] == len(paths)

    # a second warm-up of one directory, from inside it: all cached now
    r = ctl("warm", ".", cwd=m.path / "class0")
    assert r.returncode == 0, r.stderr
    stats = m.ctl("stats")
    assert stats["warm"]["path"] == "class0" and stats["warm"]["cached"] == len(paths) // 2


def test_evict_path_drops_its_entries(tree, mounter, models):
    src, paths = tree
    m = mounter(src, model=models())
    for p in paths:
        (m.path / (p + ".feat")).read_bytes()
    assert m.ctl("stats")["cache"]["namespace"]["entries"] == len(paths)

    r = ctl("--json", "evict", "class1", m.path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"command": "evict", "path": "class1",
                                    "evicted": len(paths) // 2, "entries": len(paths) // 2}
    assert m.ctl("stats")["cache"]["namespace"]["entries"] == len(paths) // 2

    # a .feat named by its absolute path in the mount stands for its image
    r = ctl("evict", m.path / (paths[0] + ".feat"))
    assert r.returncode == 0, r.stderr
    assert m.ctl("stats")["cache"]["namespace"]["entries"] == len(paths) // 2 - 1

    r = ctl("evict", "all", m.path)
    assert r.returncode == 0, r.stderr
    assert m.ctl("stats")["cache"]["namespace"]["entries"] == 0


def test_exit_codes(tree, mounter, models, tmp_path):
    src, _ = tree
    m = mounter(src, model=models())
    plain = tmp_path / "plain"
    plain.mkdir()

    r = ctl("status", plain)
    assert r.returncode == 2
    assert r.stderr.strip() == f"hapifs-ctl: {plain}: not a hapifs mount (no .hapifs/config)"
    r = ctl("stats", cwd=plain)
    assert r.returncode == 2 and "not a hapifs mount" in r.stderr

    r = ctl("frobnicate", m.path)
    assert r.returncode == 1
    assert r.stderr.startswith("hapifs-ctl: unknown command 'frobnicate'") and "usage:" in r.stderr
    assert ctl("--bogus", "status", m.path).returncode == 1
    assert ctl().returncode == 1

    r = ctl("evict", "nosuch", m.path)
    assert r.returncode == 3
    assert r.stderr.strip() == "hapifs-ctl: evict nosuch: 'nosuch': no such file or directory"
    for line in r.stderr.splitlines():
        assert line.startswith("hapifs-ctl: ")


@pytest.mark.parametrize("no_open", [1, 0])
def test_refusal_reaches_the_writers_handle(tree, mounter, models, no_open):
    """A refused command's reason is read back by the writer's open file, and only by it (with
    no_open=1 each open(2) of ctl looks it up and gets a node of its own)."""
    src, _ = tree
    m = mounter(src, model=models(), no_open=no_open)
    m.ctl("config")  # waits for the first split: a batch needs it
    ctl_file = m.path / ".hapifs" / "ctl"
    fd = os.open(ctl_file, os.O_RDWR)
    other = os.open(ctl_file, os.O_RDONLY)
    try:
        assert os.pread(fd, 65536, 0).startswith(b"# write one command per line")
        with pytest.raises(OSError) as e:
            os.write(fd, b"split 999\n")
        assert e.value.errno == errno.EINVAL
        reason = os.pread(fd, 65536, 0).decode()
        assert reason.startswith("error: ") and "999" in reason and reason.endswith("\n"), reason
        # another open file of ctl is not told: the reason is the writer's
        assert os.pread(other, 65536, 0).startswith(b"# write one command per line")
        assert os.write(fd, b"batch 8\n") == 8
        assert os.pread(fd, 65536, 0) == b"ok\n"
    finally:
        os.close(fd)
        os.close(other)
    assert m.ctl("config")["runtime"]["batch"] == 8


def test_control_files_show_their_size_without_opens(tree, mounter, models):
    """no_open=1: a control file is made when it is looked up (each open(2) and stat(2): it has
    no timeout); its size is exact, and a read returns what the lookup made."""
    src, _ = tree
    m = mounter(src, model=models())
    ctl_dir = m.path / ".hapifs"
    for name in ["config", "stats", "errors", "profile", "policy", "ctl"]:
        with open(ctl_dir / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            text = f.read()
        assert 0 < len(text) == size and text.endswith(b"\n"), (name, size, len(text))
        if name != "ctl":
            json.loads(text)
    assert (ctl_dir / "model").stat().st_size == os.stat(m.options["model"]).st_size


def test_control_files_show_a_bound_not_a_rendering(tree, mounter, models):
    """no_open=0: stat never renders a control file: every one but model shows the same bound as
    size, and a read returns the whole content up to its end."""
    src, _ = tree
    m = mounter(src, model=models(), no_open=0)
    ctl_dir = m.path / ".hapifs"
    for name in ["config", "stats", "errors", "profile", "policy", "ctl"]:
        st = (ctl_dir / name).stat()
        assert st.st_size == 4 << 20, (name, st.st_size)
        text = (ctl_dir / name).read_text()
        assert 0 < len(text) < st.st_size and text.endswith("\n")
        if name != "ctl":
            json.loads(text)
    sizes = {e.name: e.stat().st_size for e in os.scandir(ctl_dir)}  # readdirplus attributes
    assert sizes["stats"] == 4 << 20 and sizes["model"] == os.stat(m.options["model"]).st_size


def write_ctl(m, command):
    """Writes one command to .hapifs/ctl; returns what a read of the same open file says."""
    fd = os.open(m.path / ".hapifs" / "ctl", os.O_RDWR)
    try:
        os.write(fd, (command + "\n").encode())
        return os.pread(fd, 4096, 0).decode()
    finally:
        os.close(fd)


def wait_for(predicate, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_warm_stop(tmp_path, mounter, models, monkeypatch):
    """warm stop ends a warm-up in progress: its walk stops, stats say stopped, and the images
    it had not queued are not computed; a later warm starts afresh. With nothing running it
    is not an error; a folder named stop is warmed as /stop."""
    src = tmp_path / "src"
    paths = make_tree(src, classes=2, per_class=80, size=(64, 80))
    stop_dir = make_tree(src / "stop", classes=1, per_class=3, size=(64, 80))
    # while this file exists the daemon loads no image: the warm-up is surely in progress
    # when it is stopped, however fast the machine
    hold = tmp_path / "hold"
    monkeypatch.setenv("HAPIFS_TEST_HOLD", str(hold))
    m = mounter(src, model=models(), batch=1, prefetch="off")
    m.ctl("config")  # the split is chosen
    assert write_ctl(m, "warm stop") == "ok\n"
    assert m.ctl("stats")["warm"]["state"] == "idle"

    hold.touch()
    assert write_ctl(m, "warm") == "ok\n"
    # the walker queues two batches of 1, one image waits in its decode thread, and the
    # walker waits for room: stop wakes it there
    def held():
        b = m.ctl("stats")["batcher"]
        return b if b["queued"]["warm"] >= 3 and b["in_flight"] >= 1 else None
    wait_for(held)
    assert write_ctl(m, "warm stop") == "ok\n"
    held = m.ctl("stats")
    warm = held["warm"]
    assert warm["state"] == "stopped" and warm["path"] == "", warm
    assert held["feat"]["computed"] == 0, held["feat"]
    pending = sum(held["batcher"]["queued"].values()) + held["batcher"]["in_flight"]
    hold.unlink()
    # what was queued and in flight finishes; nothing more is computed
    def settled():
        a = m.ctl("stats")
        time.sleep(0.5)  # the batch in inference is not in in_flight: see that nothing moves
        b = m.ctl("stats")
        idle = not any(b["batcher"]["queued"].values()) and not b["batcher"]["in_flight"]
        return b if idle and a["feat"]["computed"] == b["feat"]["computed"] else None
    first = wait_for(settled)
    later = m.ctl("stats")
    assert later["feat"]["computed"] == first["feat"]["computed"] == pending, \
        (later["feat"], held["batcher"])
    assert pending <= 4, held["batcher"]  # three queued, one decoding
    assert later["warm"]["state"] == "stopped" and later["warm"]["eta_s"] == 0
    elapsed = later["warm"]["elapsed_s"]
    time.sleep(0.2)
    assert m.ctl("stats")["warm"]["elapsed_s"] == elapsed  # its clock stopped too

    # a new warm-up of one folder runs to the end
    assert write_ctl(m, "warm class1") == "ok\n"
    wait_for(lambda: m.ctl("stats")["warm"]["state"] == "done")
    warm = m.ctl("stats")["warm"]
    assert warm["path"] == "class1" and warm["total"] == len(paths) // 2
    assert warm["done"] == warm["total"]

    # "stop" as a folder's name
    assert write_ctl(m, "warm /stop") == "ok\n"
    wait_for(lambda: m.ctl("stats")["warm"]["state"] == "done")
    warm = m.ctl("stats")["warm"]
    assert warm["path"] == "stop" and warm["total"] == len(stop_dir)


def test_hapifs_ctl_warm_says_when_the_warm_up_is_stopped(tmp_path, mounter, models,
                                                          monkeypatch):
    src = tmp_path / "src"
    paths = make_tree(src, classes=2, per_class=80, size=(64, 80))
    hold = tmp_path / "hold"  # while it exists no image is loaded: see test_warm_stop
    monkeypatch.setenv("HAPIFS_TEST_HOLD", str(hold))
    m = mounter(src, model=models(), batch=1, prefetch="off")
    m.ctl("config")
    if not CTL.exists():
        pytest.skip(f"{CTL} is not built (set HAPI_BUILD_ROOT)")
    hold.touch()
    p = subprocess.Popen([str(CTL), "warm", str(m.path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: m.ctl("stats")["batcher"]["queued"]["warm"] >= 1)
        assert write_ctl(m, "warm stop") == "ok\n"
        hold.unlink()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 3, (out, err)
    assert "hapifs-ctl: warm: the warm-up was stopped" in err
    assert out.startswith("warm       stopped '/': ") and "took" in out
    assert m.ctl("stats")["feat"]["computed"] < len(paths)


def parse_metrics(text):
    """The Prometheus text format, strictly: {name: (type, help, [(labels, value)])}."""
    families, current = {}, None
    name_re = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    label_re = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"'
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            name, help_ = line[7:].split(" ", 1)
            assert name not in families, f"{name}: a second family of this name"
            families[name] = [None, help_, []]
            current = name
        elif line.startswith("# TYPE "):
            name, type_ = line[7:].split(" ")
            assert name == current and type_ in ("counter", "gauge"), line
            families[name][0] = type_
        else:
            m = re.fullmatch(rf"({name_re})\{{(.*)\}} (\S+)", line)
            assert m, f"not a sample line: {line!r}"
            assert m.group(1) == current, f"{line!r}: not in its family's block"
            labels = dict(re.findall(label_re, m.group(2)))
            assert ",".join(f'{k}="{v}"' for k, v in labels.items()) == m.group(2), line
            families[current][2].append((labels, float(m.group(3))))
    for name, (type_, _, samples) in families.items():
        assert type_ and samples, name
        assert name.startswith("hapifs_")
        assert (type_ == "counter") == name.endswith("_total"), f"{name} is a {type_}"
    return families


def test_metrics_are_the_stats_for_prometheus(tree, mounter, models):
    """.hapifs/metrics: every number of stats, in the text exposition format, named in the man page."""
    src, paths = tree
    m = mounter(src, model=models(), prefetch="off")
    for p in paths[:5]:
        (m.path / (p + ".feat")).read_bytes()
    stats = m.ctl("stats")
    fams = parse_metrics((m.path / ".hapifs" / "metrics").read_text())
    for _, _, samples in fams.values():
        for labels, _ in samples:
            assert labels["mountpoint"] == str(m.path)

    def value(name, **labels):
        got = [v for lab, v in fams[name][2] if all(lab.get(k) == x for k, x in labels.items())]
        assert len(got) == 1, (name, labels, fams.get(name))
        return got[0]
    assert value("hapifs_feat_computed_total") == stats["feat"]["computed"] == 5
    assert value("hapifs_feat_reads_total") == stats["feat"]["reads"]
    assert value("hapifs_cache_namespace_entries") == 5
    assert value("hapifs_batcher_samples_total") == stats["batcher"]["samples"]
    assert value("hapifs_batcher_mem_budget") == stats["batcher"]["mem_budget"]
    assert value("hapifs_cache_hit_latency_seconds") == pytest.approx(
        stats["cache"]["hit_latency_us"] / 1e6, rel=1e-6, abs=1e-9)
    assert value("hapifs_warm_state", state="idle") == 1
    # what each file cost in requests: a lookup and a read at least (no open: no_open=1)
    for t in ("lookup", "read"):
        assert stats["requests"][t] >= 5, stats["requests"]
    assert value("hapifs_requests_open_total") >= stats["requests"]["open"]
    assert fams["hapifs_uptime_seconds"][0] == "gauge"
    # every number of stats is there: one sample per numeric leaf, one per state
    def leaves(j):
        if isinstance(j, dict):
            return sum(leaves(v) for k, v in j.items() if k not in ("path", "file", "mode"))
        return 1 if isinstance(j, (int, float, str)) else 0
    assert sum(len(s) for _, _, s in fams.values()) == leaves(stats)
    # the man page names every family
    page = (Path(__file__).resolve().parent.parent / "tools" / "hapifs.8.scd").read_text()
    page = page.replace("\\_", "_")  # scdoc's escaped underscores
    missing = [n for n in fams if not re.search(rf"\b{n}\b", page)]
    assert not missing, f"not in hapifs(8): {missing}"


def test_an_input_is_refused_alike_by_option_ctl_and_hapifs_ctl(tree, mounter, models, tmp_path):
    """The policy's inputs have one table (policy/inputs.c): a mount option, a .hapifs/ctl
    command and hapifs-ctl's set- command refuse the same out-of-range value with the same
    message, naming the range."""
    src, _ = tree
    m = mounter(src, model=models())
    m.ctl("config")  # waits for the first split
    mp = tmp_path / "refused"
    mp.mkdir()
    cases = [  # name, a value just out of range, hapifs-ctl's command (None: it has none)
        ("epochs", "100001", None),
        ("epochs", "0", None),
        ("link", "999bit", "set-link"),
        ("rtt", "10.5s", "set-rtt"),
        ("client_speed", "10001", "set-client-speed"),
        ("compute_file_ms", "1001", "set-compute-file-ms"),
    ]
    for name, bad, command in cases:
        r = subprocess.run([str(HAPIFS), str(src), str(mp), "-o",
                            f"model={m.options['model']},cache={tmp_path / 'c'},{name}={bad}"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and r.stderr.startswith("hapifs: "), (name, r.stderr)
        said = r.stderr.strip()[len("hapifs: "):]
        assert said.startswith(f"{name} {bad}: expected ") and ".." in said, said
        fd = os.open(m.path / ".hapifs" / "ctl", os.O_RDWR)
        try:
            with pytest.raises(OSError) as e:
                os.write(fd, f"{name} {bad}\n".encode())
            assert e.value.errno == errno.EINVAL
            assert os.pread(fd, 4096, 0).decode() == f"error: {said}\n"
        finally:
            os.close(fd)
        if command:
            r = ctl(command, bad, m.path)
            assert r.returncode == 3 and r.stderr == f"hapifs-ctl: {said}\n", (r.stderr, said)
    assert not os.path.ismount(mp)
    assert m.ctl("config")["policy"]["epochs"] == 5  # nothing was set
