"""What the scripts of bench/ and the tests share: paths, a script as a module, a mount's daemon.

A script of bench/ has no .py name, so `import` cannot find it: load_tool loads it by path. The
scripts import this module from their own folder (they put it on sys.path first, so that it is
found when a test or another script loads them by path); tests/conftest.py does the same.
"""
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TOP = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("HAPI_BUILD_ROOT", TOP / "build"))
HAPIFS = BUILD / "fusefs" / "hapifs"
CTL = BUILD / "tools" / "hapifs-ctl"
EXPORTER = TOP / "tools" / "hapifs-export-model"
PY = "/usr/bin/python3"  # Debian's interpreter: the one with torch


def cpu_model():
    """The CPU's model name from /proc/cpuinfo, for a benchmark's heading; "?" if it has none."""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "?")


def load_tool(name):
    """bench/NAME, or a script of the tree by its path from the top (examples/train.py), as a new
    module named for the file with '_' for '-' (and no .py); each call runs the script's top
    level again (its main() runs only under __main__). Raises what the script raises."""
    path = TOP / name if "/" in name else TOP / "bench" / name
    module = path.name.removesuffix(".py").replace("-", "_")
    loader = importlib.machinery.SourceFileLoader(module, str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def resolved(path):
    """path, absolute, with the symbolic links of its parent resolved but without a stat of path
    itself: a mount point's would wait for its daemon, which may hang (or be another user's)."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def daemon_pid(mountpoint):
    """The pid of the hapifs process serving mountpoint, from /proc/*/cmdline; None if there is
    none. Stats nothing under the mount point."""
    want = resolved(mountpoint)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and os.path.basename(argv[0]) in (b"hapifs", b"mount.hapifs") \
                and resolved(os.fsdecode(argv[2])) == want:  # a path's bytes, UTF-8 or not
            return int(d.name)
    return None


def is_mounted(path):
    """Whether path is a mount point, from /proc/self/mounts (no stat of path)."""
    path = os.fsencode(resolved(path))  # its bytes, UTF-8 or not, as the kernel lists them
    with open("/proc/self/mounts", "rb") as f:
        return any(line.split()[1] == path for line in f)


def pid_alive(pid):
    """Whether process pid runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def unmount(mnt, pid, timeout=30):
    """fusermount3 -u and wait for the daemon to exit. True if both happened cleanly; else the
    mount is detached and the daemon (ours: pid is the one daemon_pid found) killed, and False."""
    clean = True
    if is_mounted(mnt):
        r = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, text=True)
        clean = r.returncode == 0
    end = time.monotonic() + timeout
    while pid and pid_alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    if pid and pid_alive(pid):
        clean = False
        os.kill(pid, 9)
    if is_mounted(mnt):
        clean = False
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    return clean


def ctl_json(mnt, name):
    """MNT/.hapifs/NAME (config, stats, policy ...) parsed; a mount still choosing its split
    answers once it has chosen. Raises OSError or ValueError."""
    return json.loads((Path(mnt) / ".hapifs" / name).read_text())


def policy_link(link, unshaped, tool):
    """tc's rate (100mbit, 1gbit) as the policy's link= option (100Mbit, 1Gbit); "none", the
    unshaped veth, as `unshaped`. Any other unit exits naming `tool`."""
    if link == "none":
        return unshaped
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", link.lower())
    if not m:
        sys.exit(f"{tool}: link {link}: give it in bit units (100mbit, 1gbit) or none")
    return m.group(1) + m.group(2).upper() + "bit"
