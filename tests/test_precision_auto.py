"""precision=auto on a real mount: fp32, bf16 and int8 loaded at mount (each with its check,
int8 calibrated on the source), those within the fidelity bound timed, a clearly slower one
pruned, the fastest kept (and read back at the next mount), served as an explicit precision=
of the same value serves it.

What is checked is that the choice follows its rule from the figures it reports, never which
precision wins: that depends on the CPU (bf16 is several times faster with AMX, slower without
any bf16 instructions; int8 pays with AMX or VNNI)."""
import json
import subprocess

import pytest

from conftest import BUILD_ROOT
from test_throughput import make_tree

CTL = BUILD_ROOT / "tools" / "hapifs-ctl"

# policy.h, HAPI_PRECISION_*
FACTOR_WARMUP, MARGIN, MIN_COSINE = 3.0, 0.95, 0.999
NAMES = ("fp32", "bf16", "int8")  # the finest first


def check_rule(pa):
    """The choice follows from the figures it gives."""
    cs = pa["candidates"]
    assert sorted(cs) == sorted(NAMES), pa
    assert pa["batch"] == 8 and pa["cpu"] and pa["min_cosine"] == MIN_COSINE, pa
    assert cs["fp32"]["min_cosine"] == cs["fp32"]["cosine"] == 1.0, pa
    assert cs["fp32"]["moved"] == 0, pa
    assert cs["bf16"]["min_cosine"] >= 0.9995 and cs["bf16"]["moved"] == 0, pa
    # int8 is calibrated with auto's bound at the freeze point, and 0.995 at every stage:
    # within it by construction, as bf16 is
    assert cs["int8"]["state"] == "absent" or (cs["int8"]["cosine"] >= MIN_COSINE and
                                               cs["int8"]["min_cosine"] >= 0.995), pa
    run = [n for n in NAMES if cs[n]["state"] in ("timed", "pruned")]
    assert "fp32" in run, pa
    spent = pruned = 0.0
    for n in NAMES:
        c = cs[n]
        assert c["state"] in ("timed", "pruned", "below_bound", "absent"), pa
        assert 0 <= c["runs"] <= 3, pa
        if c["state"] != "absent":
            assert c["setup_seconds"] > 0, pa
        assert c["min_cosine"] <= c["cosine"], pa
        if c["state"] == "below_bound":
            assert c["cosine"] < MIN_COSINE and c["warmup_ms"] == 0 and c["runs"] == 0, pa
        if n in run:
            assert c["cosine"] >= MIN_COSINE and c["warmup_ms"] > 0 and c["seconds"] > 0, pa
        spent += c["seconds"] + c["setup_seconds"]
        if c["state"] in ("pruned", "below_bound"):
            pruned += c["seconds"] + c["setup_seconds"]
    assert pa["seconds"] == pytest.approx(spent) and pa["pruned_seconds"] == \
        pytest.approx(pruned), pa
    least = min(cs[n]["warmup_ms"] for n in run)
    for n in run:  # pruned at the warm-up: clearly slower than the fastest warm-up
        if cs[n]["state"] == "pruned" and cs[n]["runs"] == 0:
            assert cs[n]["warmup_ms"] > FACTOR_WARMUP * least, pa
    left = [n for n in NAMES if cs[n]["state"] == "timed"]
    if len(left) > 1:
        assert all(cs[n]["runs"] == 3 for n in left), pa

    def figure(n):
        return cs[n]["ms"] if cs[n]["runs"] else cs[n]["warmup_ms"]

    want = left[0]
    for n in left[1:]:
        if figure(n) <= MARGIN * figure(want):
            want = n
    assert pa["chosen"] == want, pa
    assert pa["why"].startswith(want + ": "), pa


def shown(m, chosen, pa, when):
    """.hapifs/policy and hapifs-ctl policy say the precision and how auto chose it."""
    policy = m.ctl("policy")
    assert policy["precision"] == {"name": chosen, "auto": pa}, policy["precision"]
    out = subprocess.run([str(CTL), "policy", str(m.path)], capture_output=True, text=True,
                         check=True).stdout
    assert f"precision {chosen}, chosen by precision=auto {when}: {pa['why']}\n" in out, out


def test_auto_times_each_keeps_the_fastest_and_remembers(tmp_path, models, mounter):
    src = tmp_path / "src"
    paths = make_tree(src, classes=1, per_class=3, size=(64, 80))
    model = models("resnet18", 64)
    m = mounter(src, model=model, split="layer2", precision="auto", cache=str(tmp_path / "a"))
    config = m.ctl("config")
    pa = config["model"]["precision_auto"]
    chosen = config["model"]["precision"]
    assert pa["chosen"] == chosen and pa["stored"] is False and pa["to"] == \
        config["split"]["freeze"], pa
    check_rule(pa)
    assert f"precision=auto: {chosen}, measured in" in m.log_text()
    assert "every stage stays within cosine 0.995 of fp32 and the freeze point within 0.999" \
        in m.log_text()
    if chosen == "int8":
        assert config["model"]["int8_calibration"]["min_cosine"] == MIN_COSINE
    shown(m, chosen, pa, "at this mount")
    feats = {p: (m.path / (p + ".feat")).read_bytes() for p in paths}
    namespace = config["split"]["namespace"]
    m.unmount()

    # the same as precision=CHOSEN: the namespace, and the bytes
    e = mounter(src, model=model, split="layer2", precision=chosen, cache=str(tmp_path / "e"))
    assert e.ctl("config")["split"]["namespace"] == namespace
    assert "precision_auto" not in e.ctl("config")["model"]
    assert e.ctl("policy")["precision"] == {"name": chosen}
    assert all((e.path / (p + ".feat")).read_bytes() == feats[p] for p in paths)
    e.unmount()

    # the next mount reads the choice back: nothing timed
    m = mounter(src, model=model, split="layer2", precision="auto", cache=str(tmp_path / "a"))
    again = m.ctl("config")["model"]["precision_auto"]
    assert again == dict(pa, stored=True), (again, pa)
    assert f"precision=auto: {chosen}, as chosen before" in m.log_text()
    shown(m, chosen, again, "at an earlier mount")
    m.unmount()

    # a choice measured on another CPU is made again
    stored = next((tmp_path / "a").glob("precision-*.json"))
    text = json.loads(stored.read_text())
    stored.write_text(json.dumps(dict(text, cpu="Another CPU")))
    m = mounter(src, model=model, split="layer2", precision="auto", cache=str(tmp_path / "a"))
    fresh = m.ctl("config")["model"]["precision_auto"]
    assert fresh["stored"] is False and fresh["cpu"] == pa["cpu"], fresh
    check_rule(fresh)
    assert "measured on another CPU (Another CPU); choosing again" in m.log_text()
    m.unmount()

    # a choice stored before int8 was a candidate is made again
    stored.write_text(json.dumps({"version": 1, "cpu": pa["cpu"], "chosen": "bf16"}))
    m = mounter(src, model=model, split="layer2", precision="auto", cache=str(tmp_path / "a"))
    fresh = m.ctl("config")["model"]["precision_auto"]
    assert fresh["stored"] is False, fresh
    check_rule(fresh)
    assert "version 1, from before int8 was a candidate; choosing again" in m.log_text()
    m.unmount()
