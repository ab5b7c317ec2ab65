import os, signal, threading, time, random, errno, subprocess
import pytest
from conftest import abort_connection, wait_gone, is_mounted
from test_remote import storage, remote, feats  # noqa
from test_cache_life import ctl_write

@pytest.mark.parametrize("uring", [1, 0])
def test_kill(tmp_path, storage, mounter, uring):
    src, st, paths = storage(classes=4, per_class=20)
    res = []
    for trial in range(6):
        r = remote(mounter, tmp_path, [st.path], cache=f"rc{trial}", uring=uring)
        stop = threading.Event()
        def reader():
            rng = random.Random()
            while not stop.is_set():
                try:
                    (r.path / (rng.choice(paths) + ".feat")).read_bytes()
                except OSError:
                    pass
        ts = [threading.Thread(target=reader, daemon=True) for _ in range(8)]
        for t in ts: t.start()
        time.sleep(0.3 + 0.2 * trial)
        pid = r.pid
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        stop.set()
        t0 = time.monotonic()
        for t in ts: t.join(max(0.1, 5 - (time.monotonic() - t0)))
        alive = sum(t.is_alive() for t in ts)
        # does the mount answer now?
        got = {}
        def probe():
            try: os.stat(r.path / "class0"); got["e"] = 0
            except OSError as e: got["e"] = e.errno
        p = threading.Thread(target=probe, daemon=True); p.start(); p.join(3)
        hung = p.is_alive()
        if hung or alive:
            abort_connection(r.path)
        for t in ts: t.join(5)
        subprocess.run(["umount", "-l", str(r.path)], capture_output=True)
        res.append((trial, alive, hung, got.get("e")))
    print("\nRESULT uring", uring, res)
    assert all(not a and not h for _, a, h, _ in res), res
