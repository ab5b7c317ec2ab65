"""bench/bench-warm --quick: warm epochs through a mount per mode against plain files (a smoke run)."""
import json
import os
import subprocess

from conftest import BUILD_ROOT, PYTHON, SOURCE_ROOT


def test_bench_warm_quick(tmp_path):
    env = dict(os.environ, HAPI_BUILD_ROOT=str(BUILD_ROOT))
    r = subprocess.run([PYTHON, str(SOURCE_ROOT / "bench" / "bench-warm"), "--quick",
                        "--work", str(tmp_path), "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=900, env=env)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0
    row = json.loads((tmp_path / "out.json").read_text())["results"][0]
    assert len(row["plain"]) == 2 and all(x > 0 for x in row["plain"])
    for mode in ("no_open=1", "no_open=0", "watch=0"):
        assert len(row[mode]["rates"]) == 2 and all(x > 0 for x in row[mode]["rates"])
        per_file = row[mode]["requests_per_file"]
        # each file's bytes were read once: the second epoch came from the kernel's cache
        assert abs(per_file["read"] - 0.5) < 0.05, per_file
        # with opens, every file was opened in each epoch; without, none was
        want = 0.0 if mode == "no_open=1" else 1.0
        assert abs(per_file.get("open", 0) - want) < 0.05, (mode, per_file)
    assert "summary" in r.stdout
    assert not list(tmp_path.glob("mnt/*")), "left mounted"
