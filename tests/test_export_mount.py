"""Archives of the wider zoo served by a real mount, against torchvision + PIL with the
weights' own preprocessing (bicubic for EfficientNet), at several splits."""
import subprocess

import numpy as np
import pytest

from conftest import EXPORTER, PYTHON, make_image_kinds, reference_features

# arch, the splits read (by name)
ZOO = [
    ("efficientnet_b0", ["features_2", "features_8", "pool"]),
    ("convnext_tiny", ["features_3", "pool"]),
    ("regnet_y_400mf", ["trunk_output_block2", "pool"]),
    ("googlenet", ["conv1", "pool"]),
]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo-kinds")
    return root, make_image_kinds(root)


@pytest.mark.parametrize("arch,splits", ZOO, ids=[z[0] for z in ZOO])
def test_mounted_zoo_features(tmp_path, tree, mounter, arch, splits):
    src, made = tree
    archive = tmp_path / f"{arch}.pt"
    subprocess.run([PYTHON, str(EXPORTER), arch, "-o", str(archive), "--input-size", "64", "-q"],
                   check=True, capture_output=True)
    for split in splits:
        m = mounter(src, model=archive, split=split, dtype="fp32", cache=str(tmp_path / split))
        config = m.ctl("config")
        stages = [s["name"] for s in config["model"]["stages"]]
        k = stages.index(split) + 1
        for p in made:
            got = np.load(m.path / (p + ".feat"))
            ref = reference_features(archive, src / p, k)
            assert got.shape == ref.shape, (arch, split, p)
            g, w = got.ravel().astype(np.float64), ref.ravel().astype(np.float64)
            cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
            rel = np.abs(g - w).max() / np.abs(w).max()
            assert cos >= 0.99999 and rel <= 1e-3, (arch, split, p, cos, rel)
        m.unmount()
