"""Export a run's weights as a Hugging Face folder on request, and optionally push it to the hub:

  python scripts/export_model.py --config configs/albert/tiny.yaml \
      --checkpoint outputs/albert_tiny/checkpoints/step_0000020.pt --output outputs/albert_tiny/hf_step20 \
      [--push-to-hub USER/REPO]

--checkpoint takes a monitor checkpoint (step_N.pt) or a trainer's final_model.pt. Trainers export at the end of
a run and the monitor at every checkpoint (``<output_dir>/hf_model``) without this script; it serves older
checkpoints and pushing. The tokenizer comes from this machine's cache of the run (same config and overrides).
"""

import argparse
import json
import logging
from pathlib import Path

import _bootstrap  # noqa: F401  (repository root on sys.path)
import torch

from albert.export import push_to_hub
from common.config import CONFIG_KEYS_HELP, import_task_module, load_config
from common.errors import DataError, exit_on_user_error
from common.lifecycle import setup_logging
from common.task import ExportFacts

logger = logging.getLogger("export")


def last_history_entry(run_folder: Path) -> dict:
    """The last aggregated step the run recorded beside the weights (monitor or single-process history)."""
    history = run_folder / "history.jsonl"
    if not history.exists():
        return {}
    lines = [line for line in history.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else {}


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
    if not checkpoint.is_file():
        raise DataError(f"checkpoint not found: {checkpoint}")
    state = torch.load(checkpoint, map_location="cpu")
    step = state.get("step") if isinstance(state.get("step"), int) else None
    weights = state["model"] if "model" in state else state
    task = import_task_module(config.task_module).build_task(config, with_data=False)
    try:
        task.model.load_state_dict(weights)
    except RuntimeError as error:
        raise DataError(f"{checkpoint} does not match the config's model: {str(error).splitlines()[0]}") from None
    run_folder = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    last = last_history_entry(run_folder)
    if step is None:
        step = int(last.get("step", -1)) + 1
    facts = ExportFacts(
        run_id=config.collaboration.run_id,
        global_step=step,
        samples=step * config.collaboration.target_batch_size,
        exported_by=f"scripts/export_model.py from {checkpoint.name}",
        backend=config.training.backend.value,
        final_loss=last.get("loss"),
        metrics=last.get("metrics", {}),
        contributors=[],
    )
    folder = task.export_pretrained(task.model, Path(args.output), facts)
    if folder is None:
        raise DataError(f"task {config.task_module!r} has no export format")
    if args.push_to_hub:
        url = push_to_hub(folder, args.push_to_hub)
        logger.info(f"pushed {folder} to {url}")


if __name__ == "__main__":
    main()
