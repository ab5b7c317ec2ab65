#!/usr/bin/python3
"""Train a classifier on precomputed features, e.g. on a hapifs mount.

    train.py ROOT [--epochs 5] [--batch-size 32] [--lr 1e-3] [--workers 2]
                  [--seed 0] [--val-fraction 0.2]

ROOT holds one folder per class with one .feat file (a NumPy .npy array) per
sample, which is what hapifs shows over an image dataset: ROOT/<class>/x.jpg.feat
holds the output of the frozen first layers of a network for ROOT/<class>/x.jpg.
Nothing here knows about hapifs; it is a plain PyTorch script.
"""

import argparse
import time

import numpy as np
import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader, random_split


def to_float_tensor(array):
    """Features may be stored as fp16; the model computes in fp32."""
    return torch.from_numpy(array.astype(np.float32))


def make_head(in_features, num_classes, hidden=256, dropout=0.2):
    """Classifier on top of the features, whatever their shape.

    Features of a frozen network (especially one that has not been trained on
    this data) have wildly different scales per channel, so the head first
    standardizes every input (BatchNorm without affine parameters), then runs
    a small MLP.
    """
    return nn.Sequential(
        nn.Flatten(),
        nn.BatchNorm1d(in_features, affine=False),
        nn.Dropout(dropout),
        nn.Linear(in_features, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, num_classes),
    )


def run_epoch(model, loader, optimizer=None):
    """One pass over loader; trains if an optimizer is given. Returns (loss, accuracy, n)."""
    model.train(optimizer is not None)
    total_loss, correct, n = 0.0, 0, 0
    with torch.set_grad_enabled(optimizer is not None):
        for x, y in loader:
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            if optimizer is not None:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            total_loss += loss.item() * len(y)
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
    return total_loss / max(n, 1), correct / max(n, 1), n


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="folder with one subfolder of .feat files per class")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=0.2)
    args = p.parse_args()
    torch.manual_seed(args.seed)

    ds = torchvision.datasets.DatasetFolder(args.root, loader=np.load, extensions=(".feat",),
                                            transform=to_float_tensor)
    n_val = int(round(len(ds) * args.val_fraction))
    train_ds, val_ds = random_split(ds, [len(ds) - n_val, n_val],
                                    generator=torch.Generator().manual_seed(args.seed))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, drop_last=len(train_ds) > args.batch_size)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.workers)
    sample, _ = ds[0]
    print(f"{len(ds)} samples in {len(ds.classes)} classes ({', '.join(ds.classes)}), "
          f"{len(train_ds)} train / {len(val_ds)} val, feature shape {tuple(sample.shape)}")

    # Features are the output of the frozen part of a network. A split before
    # its last frozen layer would need the remaining frozen stages here, as the
    # trunk; at the pooling layer there is nothing left to run.
    trunk = nn.Identity()
    for param in trunk.parameters():
        param.requires_grad_(False)
    with torch.no_grad():
        in_features = trunk(sample[None]).flatten(1).shape[1]
    head = make_head(in_features, len(ds.classes))
    model = nn.Sequential(trunk, head)
    optimizer = torch.optim.Adam(head.parameters(), lr=args.lr)

    val_acc = float("nan")
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        loss, train_acc, n = run_epoch(model, train_loader, optimizer)
        t_train = time.time() - t0
        if len(val_ds):
            _, val_acc, _ = run_epoch(model, val_loader)
        print(f"epoch {epoch}/{args.epochs}  loss {loss:.4f}  train_acc {train_acc:.3f}  "
              f"val_acc {val_acc:.3f}  samples/s {n / t_train:.0f}  "
              f"time {time.time() - t0:.1f} s", flush=True)

    # chance: always answering the most frequent class of the validation set
    val_labels = [ds.targets[i] for i in val_ds.indices]
    chance = max(np.bincount(val_labels)) / len(val_labels) if val_labels else float("nan")
    print(f"final val_acc {val_acc:.3f} (chance {chance:.3f})")


if __name__ == "__main__":
    main()
