"""Write a synthetic CIFAR-10 (random pixels and labels) in torchvision's cifar-10-batches-py format.

    python tools/deepspeed_unit_tests/make_fake_cifar.py ROOT [--per-batch 1000]

writes ROOT/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}: latin-1 pickles of dicts with
"data" (uint8, N x 3072, channel-major rows as in the real files), "labels", "batch_label", "filenames";
batches.meta has "label_names". torchvision.datasets.CIFAR10(root=ROOT, download=False) also checks each
file's md5 against the real archive's, which random data cannot match: the harness's sitecustomize skips
that check only when DSU_FAKE_CIFAR_NO_MD5=1. DeepSpeed's tests at edaa722 read CIFAR only when
CIFAR10_DATASET_PATH (or DEEPSPEED_UNIT_DOWNLOAD_CIFAR10=1) is set; otherwise they use FakeData and need no file.
"""
import argparse
import os
import pickle

import numpy as np

NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--per-batch", type=int, default=1000, help="images per batch file (real: 10000)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = os.path.join(a.root, "cifar-10-batches-py")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(files):
        data = rng.integers(0, 256, size=(a.per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=a.per_batch).tolist()
        entry = {"batch_label": f"synthetic batch {i + 1} of 6", "labels": labels, "data": data,
                 "filenames": [f"synthetic_{i}_{j}.png" for j in range(a.per_batch)]}
        with open(os.path.join(out, name), "wb") as fh:
            pickle.dump(entry, fh, protocol=2)
    with open(os.path.join(out, "batches.meta"), "wb") as fh:
        pickle.dump({"num_cases_per_batch": a.per_batch, "label_names": NAMES, "num_vis": 3072}, fh, protocol=2)
    print(out)


if __name__ == "__main__":
    main()
