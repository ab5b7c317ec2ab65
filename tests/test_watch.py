"""Freshness with long timeouts: watch=1 lets the kernel keep names, attributes and listings for
300 s, because the daemon tells it of every change in the source as it happens (inotify).

Each test first shows that the kernel really keeps what it was given (no lookup reaches the
daemon for a name read again after more than the 1 s of watch=0), then changes the source and
shows that the very next open, listing or stat sees the change.
"""
import os
import shutil
import time

import numpy as np
from PIL import Image

from conftest import reference_features
from test_throughput import make_tree


def requests(m):
    return m.ctl("stats")["requests"]


def lookups_during(m, fn):
    """Lookups the daemon answered while fn ran (a read of .hapifs/stats costs one: a control
    file's name is never kept, so that is taken off)."""
    base = requests(m)["lookup"]
    own = requests(m)["lookup"] - base
    before = requests(m)["lookup"]
    fn()
    return requests(m)["lookup"] - before - own


def watch(m):
    return m.ctl("stats")["watch"]


# How long a change may take to show. Far more than it takes (milliseconds, or the hundreds of
# ms a notice waits for the lookups in flight on a loaded node): only a missing notice should
# ever reach it.
DEADLINE_S = 30.0


def wait_events(m, before, timeout=DEADLINE_S):
    """Waits until the daemon has read an event more than `before` from inotify. It counts an
    event before it tells the kernel what changed (watch.c, then fs.c's batch_tell), so this
    proves the change was seen, not that the kernel forgot the old names and pages yet: what
    the mount then shows is polled for with eventually()."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if watch(m)["events"] > before:
            return
        time.sleep(0.01)
    raise AssertionError(f"the daemon saw no change in the source within {timeout:.0f} s")


def eventually(what, check, timeout=DEADLINE_S):
    """Calls check() until it returns neither None nor False, and returns that: the kernel is
    told of a change a moment after the daemon counted its event. An OSError or ValueError (a
    name or bytes in the middle of the change) is retried; the last one, or the last value, is
    in the failure message."""
    end = time.monotonic() + timeout
    last = None
    while True:
        try:
            got = check()
            if got is not None and got is not False:
                return got
            last = got
        except (OSError, ValueError) as e:
            last = e
        if time.monotonic() >= end:
            raise AssertionError(f"not seen within {timeout:.0f} s: {what} (last: {last!r})")
        time.sleep(0.02)


def close(got, want):
    """got if it matches want as the checks below require (what the daemon serves is fp32 from
    the same model), else None."""
    ok = got.shape == want.shape and \
        np.allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    return got if ok else None


def new_image(path, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(path)


def test_names_are_kept_and_a_changed_image_is_seen_at_once(tmp_path, mounter, models):
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=3, size=(48, 64))
    model = models()
    m = mounter(src, model=model, prefetch="off", dtype="fp32", split=6)
    feat = m.path / "class0" / "001.jpg.feat"
    old = np.load(feat)
    assert watch(m)["dirs"] >= 2  # the root and class0
    time.sleep(1.3)  # past the 1 s of watch=0
    # Without opens (the default here) on a kernel without epoch notices (before Linux 6.16),
    # a .feat's own name is trusted for 1 s only (the bound hapifs(8) states): looked up again,
    # the same node, its bytes from the kernel's pages; the directories' names are kept. With
    # epoch notices, every name is kept.
    no_open = m.ctl("config")["runtime"]["no_open"]
    epochs = watch(m)["epochs"]
    reads = m.ctl("stats")["feat"]["reads"]
    same = []
    assert lookups_during(m, lambda: same.append(np.array_equal(np.load(feat), old))) == \
        (1 if no_open and not epochs else 0), "the kernel looked up more names than the .feat's"
    assert same == [True]
    if no_open:
        assert m.ctl("stats")["feat"]["reads"] == reads, "the pages of the .feat were not kept"

    if epochs:
        # A change elsewhere (a new image in another directory): its names are told one by one,
        # quickly here (no lookups in flight), and the other names are kept with their pages;
        # no epoch notice was needed.
        assert "other" not in os.listdir(m.path)  # the kernel keeps the root's listing
        before, notices = watch(m)["events"], watch(m)["epoch_notices"]
        (src / "other").mkdir()
        new_image(src / "other" / "x.jpg", seed=4)
        wait_events(m, before)
        # The root's listing is told last of its batch (batch_tell): once it shows "other",
        # every notice of the change was sent, so what follows checks what they left alone.
        eventually("the new directory in the root's listing",
                   lambda: "other" in os.listdir(m.path))
        reads = m.ctl("stats")["feat"]["reads"]
        same = []
        assert lookups_during(m, lambda: same.append(np.array_equal(np.load(feat), old))) == 0
        assert same == [True]
        if no_open:
            assert m.ctl("stats")["feat"]["reads"] == reads, "the pages of the .feat were dropped"
        assert watch(m)["epoch_notices"] == notices

    # Replaced by another image: a new name at once, and its features.
    before = watch(m)["events"]
    new_image(src / "class0" / "tmp.jpg", seed=5)
    os.replace(src / "class0" / "tmp.jpg", src / "class0" / "001.jpg")
    wait_events(m, before)
    want = reference_features(model, src / "class0" / "001.jpg", 6)
    now = eventually("the replaced image's features", lambda: close(np.load(feat), want))
    np.testing.assert_allclose(now, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    assert not np.array_equal(now, old)

    # Rewritten in place (same inode): the same.
    before = watch(m)["events"]
    new_image(src / "class0" / "001.jpg", seed=6)
    wait_events(m, before)
    want = reference_features(model, src / "class0" / "001.jpg", 6)
    again = eventually("the rewritten image's features", lambda: close(np.load(feat), want))
    np.testing.assert_allclose(again, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())

    # Deleted: gone from the next stat, though the kernel had the name for 300 s.
    before = watch(m)["events"]
    (src / "class0" / "001.jpg").unlink()
    wait_events(m, before)
    eventually("the deleted image's .feat gone", lambda: not feat.exists())
    assert not feat.exists()


def test_a_kept_listing_shows_what_was_added_and_removed(tmp_path, mounter, models):
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=3, size=(48, 64))
    m = mounter(src, model=models(), prefetch="off")
    d = m.path / "class0"
    first = sorted(os.listdir(d))
    assert first == ["000.jpg.feat", "001.jpg.feat", "002.jpg.feat"]
    readdirs = requests(m)["readdir"]
    assert sorted(os.listdir(d)) == first
    assert requests(m)["readdir"] == readdirs, "the kernel did not keep the listing"

    before = watch(m)["events"]
    shutil.copy(src / "class0" / "000.jpg", src / "class0" / "009.jpg")
    (src / "class0" / "002.jpg").unlink()
    (src / "class0" / "notes.txt").write_text("hello")
    wait_events(m, before)
    want = ["000.jpg.feat", "001.jpg.feat", "009.jpg.feat", "notes.txt"]
    eventually(f"the listing {want}", lambda: sorted(os.listdir(d)) == want)
    assert sorted(os.listdir(d)) == want
    assert (d / "notes.txt").read_text() == "hello"

    # A plain file changed in place: its new size and bytes, though attributes were kept.
    before = watch(m)["events"]
    (src / "class0" / "notes.txt").write_text("hello, world")
    wait_events(m, before)
    eventually("the new size and bytes of notes.txt",
               lambda: (d / "notes.txt").stat().st_size == 12 and
               (d / "notes.txt").read_text() == "hello, world")
    assert (d / "notes.txt").stat().st_size == 12
    assert (d / "notes.txt").read_text() == "hello, world"


def test_a_directory_made_again_is_watched_again(tmp_path, mounter, models):
    src = tmp_path / "src"
    make_tree(src, classes=2, per_class=2, size=(48, 64))
    m = mounter(src, model=models(), prefetch="off")
    assert sorted(os.listdir(m.path / "class1")) == ["000.jpg.feat", "001.jpg.feat"]
    dirs = watch(m)["dirs"]
    before = watch(m)["events"]
    shutil.rmtree(src / "class1")
    wait_events(m, before)
    eventually("class1 gone", lambda: not (m.path / "class1").exists())
    assert not (m.path / "class1").exists()
    before = watch(m)["events"]
    (src / "class1").mkdir()
    shutil.copy(src / "class0" / "000.jpg", src / "class1" / "005.jpg")
    wait_events(m, before)
    eventually("class1 made again, with 005.jpg.feat",
               lambda: sorted(os.listdir(m.path / "class1")) == ["005.jpg.feat"])
    assert sorted(os.listdir(m.path / "class1")) == ["005.jpg.feat"]
    assert watch(m)["dirs"] >= dirs  # the new class1 has a watch of its own
    before = watch(m)["events"]
    shutil.copy(src / "class0" / "001.jpg", src / "class1" / "006.jpg")
    wait_events(m, before)  # seen through the new directory's watch
    # the kernel keeps class1's listing for 300 s: only a notice (the new watch) shows 006
    eventually("006.jpg.feat in the new class1's listing",
               lambda: sorted(os.listdir(m.path / "class1")) == ["005.jpg.feat", "006.jpg.feat"])
    assert sorted(os.listdir(m.path / "class1")) == ["005.jpg.feat", "006.jpg.feat"]
    assert np.load(m.path / "class1" / "006.jpg.feat").size > 0


def test_watch_0_keeps_names_1_s(tmp_path, mounter, models):
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=2, size=(48, 64))
    m = mounter(src, model=models(), prefetch="off", watch=0)
    feat = m.path / "class0" / "000.jpg.feat"
    np.load(feat)
    w = watch(m)
    assert {k: w[k] for k in ("dirs", "events", "overflows", "refused", "remote",
                              "epoch_notices")} == \
        {"dirs": 0, "events": 0, "overflows": 0, "refused": 0, "remote": 0, "epoch_notices": 0}
    assert m.ctl("config")["runtime"]["watch"] is False
    time.sleep(1.3)
    assert lookups_during(m, lambda: np.load(feat)) >= 1  # the name had expired
