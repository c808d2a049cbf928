"""Export a run's weights as a Hugging Face folder on request, and optionally push it to the hub:

  python scripts/export_model.py --config configs/albert/tiny.yaml \
      --checkpoint outputs/albert_tiny/checkpoints/step_0000020.pt --output outputs/albert_tiny/hf_step20 \
      [--push-to-hub USER/REPO]

--checkpoint takes a monitor checkpoint (step_N.pt) or a trainer's final_model.pt. Trainers export at the end of
a run and the monitor at every checkpoint (``<output_dir>/hf_model``) without this script; it serves older
checkpoints and pushing. The tokenizer comes from this machine's cache of the run (same config and overrides).
The card states the facts of the checkpoint's own step: from the run's history beside it (a monitor's or single
process's ``history.jsonl``), or for ``final_model.pt`` from the trainer's ``summary.json`` and ``steps.jsonl``.
"""

import argparse
import json
import logging
from pathlib import Path

from common.checkpoints import read_state_file
from common.config import CONFIG_KEYS_HELP, import_task_module, load_config
from common.errors import DataError, exit_on_user_error
from common.export import facts_at_step, push_to_hub
from common.lifecycle import setup_logging

logger = logging.getLogger("export")


def read_rows(path: Path) -> list:
    """The per-step rows of a JSON-lines log; none if it does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoint_step(state: dict, folder: Path) -> int:
    """Global steps behind the weights: a monitor checkpoint records them; a trainer's final_model.pt has its
    summary.json beside it."""
    if isinstance(state.get("step"), int):
        return state["step"]
    summary = folder / "summary.json"
    if summary.exists():
        return int(json.loads(summary.read_text())["global_steps"])
    raise DataError(
        f"cannot tell the global step of {folder}: no step in the checkpoint and no summary.json beside it"
    )


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False, epilog=CONFIG_KEYS_HELP)
    parser.add_argument("--config", required=True, help="the run's config (model shape, tokenizer cache)")
    parser.add_argument("--checkpoint", required=True, help="step_N.pt of the monitor or final_model.pt")
    parser.add_argument("--output", required=True, help="the folder to write")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO", help="also upload the folder to this repo")
    parser.add_argument("overrides", nargs="*", help="the run's config overrides, e.g. task.vocab_size=...")
    args = parser.parse_args()
    setup_logging("export")
    config = load_config(args.config, args.overrides)
    checkpoint = Path(args.checkpoint)
    state = read_state_file(checkpoint)
    weights = state["model"] if "model" in state else state
    task = import_task_module(config.task_module).build_task(config, with_data=False)
    try:
        task.model.load_state_dict(weights)
    except RuntimeError as error:
        raise DataError(f"{checkpoint} does not match the config's model: {str(error).splitlines()[0]}") from None
    run_folder = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    step = checkpoint_step(state, checkpoint.parent)
    history = read_rows(run_folder / "history.jsonl")
    target = config.collaboration.target_batch_size
    facts = facts_at_step(
        history or read_rows(run_folder / "steps.jsonl"),
        step,
        run_id=config.collaboration.run_id,
        exported_by=f"scripts/export_model.py from {checkpoint.name}",
        backend=config.training.backend.value,
        samples_per_step=target,
    )
    if not history:  # a trainer's own records: the swarm's samples are its global steps x the target batch
        facts.samples = step * target
    folder = task.export_pretrained(task.model, Path(args.output), facts)
    if folder is None:
        raise DataError(
            f"no Hugging Face folder was written for task {config.task_module!r}: its model is not a transformers "
            f"model, or the export failed (the ERROR line above)"
        )
    if args.push_to_hub:
        url = push_to_hub(folder, args.push_to_hub)
        logger.info(f"pushed {folder} to {url}")


if __name__ == "__main__":
    main()
