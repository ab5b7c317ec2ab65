#!/usr/bin/python3
"""A linear probe on a hapifs mount, read through per-directory packs.

    probe-packs.py ROOT [--epochs 200] [--lr 0.1] [--val-fraction 0.2] [--seed 0]

ROOT holds one folder per class (as torchvision's DatasetFolder expects).
Instead of opening one .feat file per image, each class folder's features are
read as one array: ROOT/<class>/.hapifs-pack.npy, a plain .npy of shape
(images, feature shape), rows in the byte order of the image names, which
numpy.load maps without copying. Its index ROOT/<class>/.hapifs-pack.json
names the rows; a row whose image could not be computed is NaN (its index
entry says "failed" and why) and is left out here.

The probe is multinomial logistic regression on the flattened, standardized
features, trained by full-batch gradient descent in NumPy. It prints how many
samples it read, the seconds spent reading, and the train and validation
accuracy against chance.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

PACK, INDEX = ".hapifs-pack.npy", ".hapifs-pack.json"


def load(root):
    """(features [n, d] float32, labels [n], class names, skipped rows) from the packs."""
    classes = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, PACK)))
    xs, ys, skipped = [], [], 0
    for label, cls in enumerate(classes):
        rows = np.load(os.path.join(root, cls, PACK), mmap_mode="r")
        with open(os.path.join(root, cls, INDEX)) as f:
            assert json.load(f)["count"] == rows.shape[0]
        flat = np.asarray(rows, dtype=np.float32).reshape(rows.shape[0], -1)
        good = ~np.isnan(flat).any(axis=1)
        skipped += int((~good).sum())
        xs.append(flat[good])
        ys.append(np.full(int(good.sum()), label))
    if not xs:
        sys.exit(f"probe-packs.py: no class folder with a {PACK} under {root}")
    return np.concatenate(xs), np.concatenate(ys), classes, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--val-fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    start = time.monotonic()
    x, y, classes, skipped = load(a.root)
    read_s = time.monotonic() - start
    rng = np.random.default_rng(a.seed)
    order = rng.permutation(len(y))
    n_val = int(len(y) * a.val_fraction)
    val, train = order[:n_val], order[n_val:]
    mean, std = x[train].mean(0), x[train].std(0) + 1e-6
    x = (x - mean) / std

    k = len(classes)
    w = np.zeros((x.shape[1], k), np.float32)
    b = np.zeros(k, np.float32)
    onehot = np.eye(k, dtype=np.float32)[y[train]]
    for _ in range(a.epochs):
        logits = x[train] @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = (p - onehot) / len(train)
        w -= a.lr * (x[train].T @ g)
        b -= a.lr * g.sum(0)

    def accuracy(idx):
        return float(((x[idx] @ w + b).argmax(1) == y[idx]).mean()) if len(idx) else float("nan")

    print(f"read {len(y)} samples of {x.shape[1]} features from {k} packs in {read_s:.2f} s "
          f"({skipped} failed rows left out)")
    print(f"train accuracy {accuracy(train):.3f}, validation accuracy {accuracy(val):.3f}, "
          f"chance {1 / k:.3f}")


if __name__ == "__main__":
    main()
