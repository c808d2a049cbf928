"""Linear-probe and kNN top-1 of frozen SwAV trunk features on Fashion-MNIST (train -> t10k).

    python scripts/swav_linear_eval.py --config configs/swav/tiny.yaml [--state outputs/run/trainer0/final_model.pt]
        [--label collaborative] [--csv paper_results/swav/linear_eval.csv] [key=value ...]

Without ``--state`` the configured model's seeded random initialisation is evaluated (the baseline).
"""

import csv
import json
import logging
from pathlib import Path

import torch

from common.config import load_config, script_argument_parser
from common.errors import ConfigError, exit_on_user_error
from common.lifecycle import setup_logging
from swav.linear_eval import evaluate, large_crop_size, load_model

logger = logging.getLogger("swav_linear_eval")

CSV_FIELDS = [
    "label",
    "state",
    "linear_top1",
    "knn_top1",
    "train_images",
    "test_images",
    "feature_dim",
    "eval_seconds",
    "command",
]


def parse_arguments():
    parser = script_argument_parser(__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--state", default=None, help="a trainer's final_model.pt (default: random init)")
    parser.add_argument("--label", default=None, help="row label in the CSV (default: the state path or random_init)")
    parser.add_argument("--max-train", type=int, default=10000, help="train images for the probe (of 60,000)")
    parser.add_argument("--max-test", type=int, default=10000, help="t10k images to score (of 10,000)")
    parser.add_argument("--knn-k", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--csv", default=None, help="append the result as a row of this CSV")
    parser.add_argument("--command", default="", help="the training command, recorded in the CSV row")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args()


@exit_on_user_error
def main() -> None:
    args = parse_arguments()
    setup_logging("swav_eval")
    if args.max_train < 10 or args.max_test < 1 or args.knn_k < 1 or args.threads < 1:
        raise ConfigError("--max-train must be >= 10, --max-test, --knn-k and --threads >= 1")
    torch.set_num_threads(args.threads)
    config = load_config(args.config, args.overrides)
    if config.task_module != "swav":
        raise ConfigError(f"{args.config} is not a SwAV config (task_module: {config.task_module})")
    model = load_model(config, args.state)
    result = evaluate(
        model,
        large_crop_size(config.task.crop_sizes),
        config.task.fashion_mnist_dir,
        args.max_train,
        args.max_test,
        args.knn_k,
    )
    label = args.label or (args.state or "random_init")
    row = {
        "label": label,
        "state": args.state or "",
        "linear_top1": f"{result.linear_top1:.4f}",
        "knn_top1": f"{result.knn_top1:.4f}",
        "train_images": result.train_images,
        "test_images": result.test_images,
        "feature_dim": result.feature_dim,
        "eval_seconds": f"{result.seconds:.1f}",
        "command": args.command,
    }
    logger.info(json.dumps(row))
    if args.csv:
        path = Path(args.csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        new_file = not path.exists()
        with path.open("a", newline="") as stream:
            writer = csv.DictWriter(stream, fieldnames=CSV_FIELDS)
            if new_file:
                writer.writeheader()
            writer.writerow(row)


if __name__ == "__main__":
    main()
