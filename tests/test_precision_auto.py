"""precision=auto on a real mount: fp32 and bf16 both timed at mount, a clearly slower one
pruned, the faster kept (and read back at the next mount), served as an explicit
precision= of the same value serves it.

What is checked is that the choice follows its rule from the figures it reports, never which
precision wins: that depends on the CPU (bf16 is several times faster with AMX, slower without
any bf16 instructions)."""
import json

from test_throughput import make_tree

FACTOR_WARMUP, FACTOR, MARGIN = 2.0, 1.5, 0.95  # policy.h, HAPI_PRECISION_*


def check_rule(pa):
    """The choice follows from the figures it gives."""
    other = {"fp32": "bf16", "bf16": "fp32"}
    assert pa["batch"] == 8 and pa["cpu"] and pa["seconds"] >= pa["pruned_seconds"] >= 0, pa
    assert pa["bf16_min_cosine"] >= 0.9995 and pa["bf16_moved"] == 0, pa
    if pa["pruned"]:
        p, kept = pa["pruned"], other[pa["pruned"]]
        assert pa["chosen"] == kept and pa["pruned_seconds"] > 0, pa
        if pa["runs"][p] == 0:  # at the warm-up
            assert pa["warmup_ms"][p] > FACTOR_WARMUP * pa["warmup_ms"][kept], pa
            assert pa["runs"][kept] == 0, pa
        else:
            assert pa["runs"][p] >= 1 and pa["ms"][p] > 0, pa
    else:
        assert pa["runs"] == {"fp32": 3, "bf16": 3} and pa["pruned_seconds"] == 0, pa
        want = "bf16" if pa["ms"]["bf16"] <= MARGIN * pa["ms"]["fp32"] else "fp32"
        assert pa["chosen"] == want, pa


def test_auto_times_both_keeps_the_faster_and_remembers(tmp_path, models, mounter):
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
    feats = {p: (m.path / (p + ".feat")).read_bytes() for p in paths}
    namespace = config["split"]["namespace"]
    m.unmount()

    # the same as precision=CHOSEN: the namespace, and the bytes
    e = mounter(src, model=model, split="layer2", precision=chosen, cache=str(tmp_path / "e"))
    assert e.ctl("config")["split"]["namespace"] == namespace
    assert "precision_auto" not in e.ctl("config")["model"]
    assert all((e.path / (p + ".feat")).read_bytes() == feats[p] for p in paths)
    e.unmount()

    # the next mount reads the choice back: nothing timed
    m = mounter(src, model=model, split="layer2", precision="auto", cache=str(tmp_path / "a"))
    again = m.ctl("config")["model"]["precision_auto"]
    assert again == dict(pa, stored=True), (again, pa)
    assert f"precision=auto: {chosen}, as chosen before" in m.log_text()
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

    # a choice where neither was pruned ("pruned": null) is read back too
    text = json.loads(stored.read_text())
    stored.write_text(json.dumps(dict(text, pruned=None, pruned_seconds=0.0)))
    m = mounter(src, model=model, split="layer2", precision="auto", cache=str(tmp_path / "a"))
    back = m.ctl("config")["model"]["precision_auto"]
    assert back["stored"] is True and back["pruned"] is None, back
    m.unmount()
