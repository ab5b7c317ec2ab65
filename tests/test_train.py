"""The main job on a small scale: sample dataset, staged model, mount, examples/train.py learns."""
import re
import subprocess

from conftest import PYTHON, SOURCE_ROOT


def test_train_on_mounted_features(tmp_path, models, mounter):
    data = tmp_path / "data"
    subprocess.run([PYTHON, str(SOURCE_ROOT / "examples" / "make-dataset"), str(data),
                    "--classes", "4", "--per-class", "60"], check=True,
                   stdout=subprocess.DEVNULL)
    m = mounter(data, model=models("resnet18", 112))
    r = subprocess.run([PYTHON, str(SOURCE_ROOT / "examples" / "train.py"), str(m.path),
                        "--epochs", "10", "--workers", "2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    epochs = re.findall(r"^epoch (\d+)/10 .*val_acc ([0-9.]+)", r.stdout, re.M)
    assert len(epochs) == 10
    final = re.search(r"final val_acc ([0-9.]+) \(chance ([0-9.]+)\)", r.stdout)
    acc, chance = float(final.group(1)), float(final.group(2))
    assert acc >= 0.6 and acc >= chance + 0.25, r.stdout
    st = m.ctl("stats")
    assert st["feat"]["computed"] == 240
    assert st["feat"]["failed"] == 0
