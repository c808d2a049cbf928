"""Plot the SwAV linear-evaluation table and the runs' loss curves for paper_results/swav/.

    python scripts/experiments/swav_results.py --csv paper_results/swav/linear_eval.csv \
        --png paper_results/swav/linear_eval.png \
        --curve single=outputs/swav_single/steps.jsonl --curve collaborative=outputs/swav_collab/trainer0/steps.jsonl
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Dict, List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from common.errors import DataError, exit_on_user_error  # noqa: E402


def read_rows(path: Path) -> List[dict]:
    if not path.is_file():
        raise DataError(f"results table {path} does not exist (run scripts/swav_linear_eval.py --csv first)")
    with path.open() as stream:
        return list(csv.DictReader(stream))


def read_curve(path: Path) -> Tuple[List[int], List[float]]:
    if not path.is_file():
        raise DataError(f"step log {path} does not exist")
    steps, losses = [], []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        steps.append(int(record["step"]) + 1)
        losses.append(float(record["loss"]))
    return steps, losses


def plot(rows: List[dict], curves: Dict[str, Path], output: Path) -> None:
    figure, (bars, losses) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [row["label"] for row in rows]
    positions = range(len(rows))
    width = 0.38
    linear = [100 * float(row["linear_top1"]) for row in rows]
    knn = [100 * float(row["knn_top1"]) for row in rows]
    bars.bar([x - width / 2 for x in positions], linear, width, label="linear probe")
    bars.bar([x + width / 2 for x in positions], knn, width, label="kNN (k=20)")
    for x, (a, b) in enumerate(zip(linear, knn)):
        bars.text(x - width / 2, a + 0.5, f"{a:.1f}", ha="center", fontsize=8)
        bars.text(x + width / 2, b + 0.5, f"{b:.1f}", ha="center", fontsize=8)
    bars.set_xticks(list(positions), labels)
    bars.set_ylabel("Fashion-MNIST t10k top-1 (%)")
    bars.set_ylim(0, 100)
    bars.set_title("Frozen SwAV trunk features")
    bars.legend(loc="lower right")
    for name, path in curves.items():
        steps, values = read_curve(path)
        losses.plot(steps, values, label=name)
    losses.set_xlabel("global step (target batch 256 samples)")
    losses.set_ylabel("SwAV loss, mean over the step's micro-batches")
    losses.set_title("Training loss")
    losses.legend()
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    plt.close(figure)


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", required=True)
    parser.add_argument("--png", required=True)
    parser.add_argument("--curve", action="append", default=[], help="name=path/to/steps.jsonl")
    args = parser.parse_args()
    curves = {}
    for item in args.curve:
        name, _, path = item.partition("=")
        if not path:
            raise DataError(f"--curve {item!r} must be name=path")
        curves[name] = Path(path)
    plot(read_rows(Path(args.csv)), curves, Path(args.png))


if __name__ == "__main__":
    main()
