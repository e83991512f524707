"""Split soc-LiveJournal1.txt.gz into train.parquet (75% of the edges) and test.parquet
(25%), shuffled with a fixed seed, as PyTorch-BigGraph's livejournal example does.

    python examples/livejournal/split.py [DATA_DIR]   (default: $PBG_RAY_DATA or ./data)

Columns src (follower) and dst (followed): SNAP's integer ids, which the importer reads
as entity names.
"""

import os
import sys

import numpy as np
import pandas as pd

TRAIN_FRACTION = 0.75
SEED = 0


def split(data_dir: str) -> None:
    outputs = [os.path.join(data_dir, f"{name}.parquet") for name in ("train", "test")]
    if all(os.path.exists(path) for path in outputs):
        print(f"{data_dir}: train.parquet and test.parquet are already there")
        return
    # SNAP's file: '#' comment lines, then "FromNodeId<TAB>ToNodeId" per line.
    edges = pd.read_csv(os.path.join(data_dir, "soc-LiveJournal1.txt.gz"), sep="\t",
                        comment="#", header=None, names=["src", "dst"], dtype="int64")
    order = np.random.default_rng(SEED).permutation(len(edges))
    cut = int(len(edges) * TRAIN_FRACTION)
    for path, rows in zip(outputs, (order[:cut], order[cut:])):
        edges.iloc[rows].to_parquet(path + ".part", index=False)
        os.replace(path + ".part", path)  # complete files only
        print(f"{path}: {len(rows)} edges")


if __name__ == "__main__":
    default = os.environ.get("PBG_RAY_DATA") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                             "data")
    split(sys.argv[1] if len(sys.argv) > 1 else default)
