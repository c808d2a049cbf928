"""Fine-tune a pretrained ALBERT on a downstream task with several seeds (sahajBERT's evaluation protocol):

  python scripts/finetune.py --task wiki_topic --config configs/albert/tiny.yaml \
      --checkpoint outputs/albert_single/final_model.pt --seeds 3 --output paper_results/sahajbert/x.json

  python scripts/finetune.py --task wiki_topic --model outputs/albert_single/hf_model --seeds 3
  python scripts/finetune.py --task wikiann_bn --model neuropark/sahajBERT   (where the hub is reachable)

Tasks: wikiann_bn (NER F1) and sna_bn (accuracy) from the hub at full scale; offline substitutes wiki_mentions
(link-anchor mention tagging, F1) and wiki_topic (Wikipedia topic classification, accuracy). The model and
tokenizer come either from --model (an exported Hugging Face folder or a hub name: its own tokenizer) or from the
pretraining run's --config (same task.* settings and cache) with --checkpoint; --config without --checkpoint means
a randomly initialised encoder of the run's shape (the no-pretraining baseline).
"""

import argparse
import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from albert.sahajbert.downstream import (
    METRIC,
    SEQUENCE_TASKS,
    TOKEN_TASKS,
    FinetuneSettings,
    finetune_one_seed,
    load_task,
    summarise,
)
from albert.task import build_dataset, build_model
from common.checkpoints import read_state_file
from common.config import CONFIG_KEYS_HELP, load_config
from common.errors import ConfigError, DataError, exit_on_user_error
from common.lifecycle import setup_logging

logger = logging.getLogger("finetune")


def load_published_model(name: str):
    """Tokenizer and config of an exported folder or a hub model; nothing is downloaded where the hub is off."""
    try:
        return AutoTokenizer.from_pretrained(name), AutoConfig.from_pretrained(name)
    except Exception as error:  # a missing folder, an unreachable hub, an unknown name
        where, hint = (
            ("folder", "") if Path(name).exists() else ("hub model", " (is the hub reachable? or pass a folder)")
        )
        raise DataError(f"cannot load {where} {name!r}{hint}: {' '.join(str(error).split())[:160]}") from None


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False, epilog=CONFIG_KEYS_HELP)
    parser.add_argument("--task", required=True, choices=sorted({*TOKEN_TASKS, *SEQUENCE_TASKS}))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="the pretraining run's config (model shape, tokenizer)")
    source.add_argument("--model", help="a Hugging Face folder (a run's hf_model) or a hub model name")
    parser.add_argument("--checkpoint", default=None, help="final_model.pt of the pretraining run (with --config)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--max-train-examples", type=int, default=None)
    parser.add_argument("--max-eval-examples", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="JSON file for the per-seed and summary results")
    parser.add_argument("overrides", nargs="*", help="overrides of the pretraining config, e.g. task.cache_dir=...")
    args = parser.parse_args()
    if args.seeds < 1:
        raise ConfigError("--seeds must be >= 1")
    try:
        settings = FinetuneSettings.from_arguments(args)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    setup_logging("finetune")
    torch.set_num_threads(args.threads)
    if args.model is not None:
        if args.checkpoint is not None or args.overrides:
            raise ConfigError("--model brings its own weights and tokenizer: drop --checkpoint and overrides")
        tokenizer, model_config = load_published_model(args.model)
    else:
        run_config = load_config(args.config, args.overrides)
        if run_config.task_module != "albert":
            raise ConfigError(f"{args.config} is not an ALBERT run (task_module {run_config.task_module!r})")
        tokenizer, _ = build_dataset(run_config.task)
        model_config = build_model(run_config.task, run_config.task.vocab_size).config
    pretrained = None
    if args.checkpoint is not None:
        pretrained = read_state_file(Path(args.checkpoint))
    kind, splits = load_task(args.task, seed=0)
    logger.info(
        f"{args.task}: {len(splits.train)} train / {len(splits.validation)} validation / "
        f"{len(splits.test)} test examples, {len(splits.labels)} labels"
    )
    runs = [
        finetune_one_seed(kind, splits, tokenizer, model_config, pretrained, settings, seed, args.model)
        for seed in range(args.seeds)
    ]
    summary = {
        "task": args.task,
        "metric": METRIC[kind],
        "config": args.config,
        "checkpoint": args.checkpoint,
        "model": args.model,
        "settings": vars(settings),
        **summarise(runs),
    }
    logger.info(
        f"{args.task} ({summary['metric']}): {100 * summary['test_mean']:.2f} +- "
        f"{100 * summary['test_std']:.2f} over {args.seeds} seeds"
    )
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
