"""A mount with allow_other on a shared node: other users read what the source lets them read.

Each test mounts for real as root and acts as second users made here (useradd), through
su. Mount points live under a directory every user can search (pytest's own tmp_path is
root's, mode 0700).
"""
import fcntl
import grp
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import need_hapifs
from test_throughput import make_tree

USER = "hapifs-t1"       # in no group of ours
MEMBER = "hapifs-t2"     # in CTL_GROUP
CTL_GROUP = "hapifs-tctl"


def ensure_users():
    """Makes the second users and the group once. Under a lock: tests of two pytest processes
    (or workers) may ask at once on a fresh machine, and useradd fails for a user that another
    made meanwhile."""
    with open("/run/lock/hapifs-tests-users.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            grp.getgrnam(CTL_GROUP)
        except KeyError:
            subprocess.run(["groupadd", "--system", CTL_GROUP], check=True)
        for name, groups in ((USER, []), (MEMBER, [CTL_GROUP])):
            try:
                pwd.getpwnam(name)
            except KeyError:
                subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh",
                                *(["-G", ",".join(groups)] if groups else []), name],
                               check=True)


def as_user(user, cmd):
    """Runs a shell command as user (su sets its groups); returns the CompletedProcess."""
    return subprocess.run(["su", "-s", "/bin/sh", user, "-c", cmd], capture_output=True,
                          text=True, timeout=60)


def reads(user, path):
    return as_user(user, f"cat '{path}' > /dev/null")


def users_top(prefix):
    """The second users made, and a new directory under /tmp every user can search (the
    caller removes it); skips a test where users cannot be made."""
    need_hapifs()
    if shutil.which("useradd") is None or shutil.which("su") is None:
        pytest.skip("needs useradd and su")
    ensure_users()
    top = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(top, 0o755)
    return top


@pytest.fixture
def shared(mounter):
    """shared(**opts) -> (source, Mount): a tree with private corners, mounted with allow_other."""
    top = users_top("hapifs-perm-")

    def make(models, **opts):
        src = top / "src"
        make_tree(src, classes=1, per_class=3, size=(40, 56), seed=3)  # class0/*.jpg, 0644
        names = sorted(p.name for p in (src / "class0").iterdir())
        os.chmod(src / "class0" / names[0], 0o600)          # root's own image
        (src / "secret").mkdir()
        shutil.copy(src / "class0" / names[1], src / "secret" / "hidden.jpg")
        os.chmod(src / "secret", 0o700)                      # a folder only root may list
        for d in (src, src / "class0"):
            os.chmod(d, 0o755)
        opts.setdefault("model", models())
        opts.setdefault("prefetch", "off")
        opts.setdefault("cache", str(top / "cache"))
        m = mounter(src, top / "mnt", allow_other=None, **opts)
        made.append(m)
        m.ctl("config")
        return src, m, names

    made = []
    make.top = top
    yield make
    # before the tree goes: every mount beneath top, the last made first
    under = [l.split()[1] for l in Path("/proc/mounts").read_text().splitlines()
             if l.split()[1].startswith(str(top) + "/")]
    for mp in reversed(under):
        subprocess.run(["fusermount3", "-u", mp], check=False)
    for m in made:
        m.unmount()
    shutil.rmtree(top, ignore_errors=True)


def test_other_users_read_what_the_source_lets_them_read(shared, models):
    src, m, names = shared(models)
    mnt = m.path
    # default_permissions is on although the operator did not write it
    line = next(l for l in Path("/proc/mounts").read_text().splitlines()
                if l.split()[1] == str(mnt))
    assert "default_permissions" in line.split()[3] and "allow_other" in line.split()[3]

    public, private = mnt / "class0" / (names[1] + ".feat"), mnt / "class0" / (names[0] + ".feat")
    assert reads(USER, public).returncode == 0
    r = reads(USER, private)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert private.read_bytes()  # root reads it
    r = as_user(USER, f"ls '{mnt / 'secret'}'")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert reads(USER, mnt / "secret" / "hidden.jpg.feat").returncode != 0
    assert os.listdir(mnt / "secret") == ["hidden.jpg.feat"]

    # a pack holds the features of every image in its folder: all of them must be readable
    pack = mnt / "class0" / ".hapifs-pack.npy"
    r = reads(USER, pack)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert len(pack.read_bytes()) == os.stat(pack).st_size  # root reads it
    os.chmod(src / "class0" / names[0], 0o644)
    time.sleep(1.5)  # the kernel keeps attributes for 1 s
    assert reads(USER, pack).returncode == 0
    assert reads(USER, private).returncode == 0

    # .hapifs/model is readable as the model file is
    model = Path(m.options["model"])
    assert reads(USER, mnt / ".hapifs" / "model").returncode == 0
    os.chmod(model, 0o600)
    try:
        time.sleep(1.5)
        assert reads(USER, mnt / ".hapifs" / "model").returncode != 0
    finally:
        os.chmod(model, 0o644)


def test_ctl_takes_commands_from_root_the_owner_and_ctl_group(shared, models):
    src, m, names = shared(models, ctl_group=CTL_GROUP)
    ctl = m.path / ".hapifs" / "ctl"
    st = os.stat(ctl)
    assert st.st_gid == grp.getgrnam(CTL_GROUP).gr_gid and st.st_mode & 0o777 == 0o664
    batch = m.ctl("config")["runtime"]["batch"]
    r = as_user(USER, f"echo 'batch 3' > '{ctl}'")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert m.ctl("config")["runtime"]["batch"] == batch != 3
    r = as_user(MEMBER, f"echo 'batch 3' > '{ctl}'")
    assert r.returncode == 0, r.stderr
    assert m.ctl("config")["runtime"]["batch"] == 3
    # anyone may read what the mount does
    for name in ("config", "stats", "policy", "profile"):
        r = as_user(USER, f"cat '{m.path / '.hapifs' / name}'")
        assert r.returncode == 0 and json.loads(r.stdout), name


def test_without_ctl_group_only_root_and_the_owner_command(shared, models):
    src, m, names = shared(models)
    ctl = m.path / ".hapifs" / "ctl"
    assert os.stat(ctl).st_mode & 0o777 == 0o644
    for user in (USER, MEMBER):
        for cmd in ("evict all", "split 3"):
            r = as_user(user, f"echo '{cmd}' > '{ctl}'")
            assert r.returncode != 0 and "Permission denied" in r.stderr, (user, cmd)


def test_a_bad_ctl_group_is_refused(shared, models):
    with pytest.raises(RuntimeError, match="ctl_group=no-such-group-hapifs: no such group"):
        shared(models, ctl_group="no-such-group-hapifs")


def test_errors_show_a_user_only_the_names_it_could_list(shared, models):
    src, m, names = shared(models)
    (src / "class0" / "broken.jpg").write_bytes(b"\xff")
    (src / "secret" / "broken-secret.jpg").write_bytes(b"\xff")
    for p in ("class0/broken.jpg.feat", "secret/broken-secret.jpg.feat"):
        with pytest.raises(OSError):
            (m.path / p).read_bytes()
    mine = m.ctl("errors")
    paths = {e["path"] for e in mine["errors"]}
    assert {"class0/broken.jpg", "secret/broken-secret.jpg"} <= paths
    assert "hidden" not in mine
    r = as_user(USER, f"cat '{m.path / '.hapifs' / 'errors'}'")
    assert r.returncode == 0, r.stderr
    theirs = json.loads(r.stdout)
    assert "class0/broken.jpg" in {e["path"] for e in theirs["errors"]}
    assert "secret/broken-secret.jpg" not in r.stdout
    assert theirs["hidden"] >= 1 and theirs["count"] == mine["count"]


def test_a_remote_mount_shows_each_feat_as_readable_as_its_directory(shared, models, mounter):
    src, st, names = shared(models)
    (src / "locked").mkdir()
    shutil.copy(src / "class0" / names[1], src / "locked" / "x.jpg")
    os.chmod(src / "locked", 0o711)  # others may look a name up, not list or read
    os.chmod(src / "class0" / names[0], 0o644)
    r = mounter(st.path, shared.top / "rmnt", remote=None, features="split", allow_other=None,
                cache=str(shared.top / "rcache"))
    assert reads(USER, r.path / "class0" / (names[1] + ".feat")).returncode == 0
    locked = r.path / "locked" / "x.jpg.feat"
    assert as_user(USER, f"stat '{locked}'").returncode == 0
    res = reads(USER, locked)
    assert res.returncode != 0 and "Permission denied" in res.stderr
    assert locked.read_bytes() == (st.path / "locked" / "x.jpg.feat").read_bytes()
    assert reads(USER, r.path / "secret" / "hidden.jpg.feat").returncode != 0
    # other users see none of a remote mount's errors listed
    res = as_user(USER, f"cat '{r.path / '.hapifs' / 'errors'}'")
    assert res.returncode == 0 and json.loads(res.stdout)["errors"] == []
