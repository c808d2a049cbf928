"""Does pretraining help downstream? Fine-tune exported models and a random init of the same shape, several seeds:

  python scripts/experiments/downstream_gain.py --model swarm=outputs/albert_tiny/trainer0/hf_model \
      --model single=outputs/albert_single/hf_model --seeds 3 --output paper_results/sahajbert/downstream_gain

Every --model is a Hugging Face folder exported by a run (``hf_model``). The random-init row uses the first
folder's config and tokenizer with fresh weights, so every row sees the same tokens and the same architecture; only
the initial encoder weights differ. Writes ``<output>.json`` (per-seed scores) and ``<output>.md`` (the table).
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from albert.sahajbert.downstream import METRIC, FinetuneSettings, finetune_one_seed, load_task, summarise
from common.errors import ConfigError, DataError, exit_on_user_error
from common.lifecycle import setup_logging

logger = logging.getLogger("downstream_gain")
RANDOM_INIT = "random init"


def parse_models(items: list) -> dict:
    models = {}
    for item in items:
        label, _, folder = item.partition("=")
        if not folder:
            raise ConfigError(f"--model takes LABEL=FOLDER (got {item!r})")
        if not (Path(folder) / "config.json").is_file():
            raise DataError(f"--model {label}: {folder} is not an exported Hugging Face folder (no config.json)")
        models[label] = folder
    if not models:
        raise ConfigError("give at least one --model LABEL=FOLDER")
    return models


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", action="append", default=[], metavar="LABEL=FOLDER")
    parser.add_argument("--tasks", nargs="+", default=["wiki_topic", "wiki_mentions"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--max-train-examples", type=int, default=1000)
    parser.add_argument("--max-eval-examples", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", required=True, help="path prefix for the .json and .md results")
    args = parser.parse_args()
    models = parse_models(args.model)
    unknown = sorted(set(args.tasks) - {"wiki_topic", "wiki_mentions"})
    if unknown:
        raise ConfigError(f"--tasks: offline substitutes only (wiki_topic, wiki_mentions), not {', '.join(unknown)}")
    if args.seeds < 2:
        raise ConfigError("--seeds must be >= 2 (the spread is part of the result)")
    setup_logging("downstream")
    torch.set_num_threads(args.threads)
    first = next(iter(models.values()))
    tokenizer = AutoTokenizer.from_pretrained(first)
    shape = AutoConfig.from_pretrained(first)
    max_length = min(shape.max_position_embeddings, 64)
    settings = FinetuneSettings.from_arguments(args, batch_size=32, max_length=max_length)
    started = time.time()
    results = {"settings": vars(settings), "models": {**models, RANDOM_INIT: f"{first} (config only)"}, "tasks": {}}
    for task in args.tasks:
        kind, splits = load_task(task, seed=0)
        rows = {}
        for label, folder in [*models.items(), (RANDOM_INIT, None)]:
            runs = [
                finetune_one_seed(kind, splits, tokenizer, shape, None, settings, seed, folder)
                for seed in range(args.seeds)
            ]
            rows[label] = summarise(runs)
            logger.info(f"{task} {label}: {100 * rows[label]['test_mean']:.2f} +- {100 * rows[label]['test_std']:.2f}")
        results["tasks"][task] = {"metric": METRIC[kind], "rows": rows}
    results["seconds"] = round(time.time() - started, 1)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    output.with_suffix(".md").write_text(table(results, " ".join(["python", *sys.argv])))
    logger.info(f"wrote {output.with_suffix('.json')} and {output.with_suffix('.md')}")


def table(results: dict, command: str) -> str:
    tasks = list(results["tasks"])
    header = "| model | " + " | ".join(f"{task} ({results['tasks'][task]['metric']}, %)" for task in tasks) + " |"
    lines = [header, "|---" * (len(tasks) + 1) + "|"]
    for label in results["models"]:
        cells = []
        for task in tasks:
            row = results["tasks"][task]["rows"][label]
            cells.append(f"{100 * row['test_mean']:.2f} +- {100 * row['test_std']:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    gains = []
    for task in tasks:
        rows = results["tasks"][task]["rows"]
        base = rows[RANDOM_INIT]
        for label in results["models"]:
            if label == RANDOM_INIT:
                continue
            gain = rows[label]["test_mean"] - base["test_mean"]
            spread = max(rows[label]["test_std"], base["test_std"])
            gains.append(
                f"- {task}, {label} vs random init: {100 * gain:+.2f} points "
                f"({'more' if gain > spread else 'NOT more'} than the larger std, {100 * spread:.2f})"
            )
    seeds = next(iter(next(iter(results["tasks"].values()))["rows"].values()))["seeds"]
    return (
        f"Command: `{command}` ({results['seconds']:.0f} s). Test score of the epoch chosen on validation, "
        f"mean +- std over {seeds} seeds; settings {results['settings']}.\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n".join(gains)
        + "\n"
    )


if __name__ == "__main__":
    main()
