"""What a refactor of the config flow must leave unchanged, written to one folder for ``diff -r``.

* ``configs/``: every run config under ``configs/`` resolved with each set of overrides the tests and README use
  (``to_yaml``), and what its precision resolves to on this machine (CPU); the emulated networks and cost-model
  setups through their own loaders;
* ``help/``: the ``--help`` text of every ``scripts/*.py`` and ``scripts/experiments/*.py``.

Usage (from the repository root): ``.venv/bin/python tests/behaviour_snapshot.py OUT_DIR``, once before and once
after a change, then ``diff -r BEFORE AFTER``. Not a test: the ``--help`` half starts one interpreter per script.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

logger = logging.getLogger("behaviour_snapshot")

# the overrides tests/conftest.py (tiny_overrides, tiny_ddp_overrides) and the README's commands use, and the other
# backend/semantics pairs the schema accepts
TINY = [
    "monitor.wandb_mode=disabled",
    "monitor.refresh_seconds=0.5",
    "training.log_every_seconds=5",
    "collaboration.matchmaking_time=1.5",
    "collaboration.averaging_timeout=20",
    "collaboration.final_averaging_seconds=3",
]
OVERRIDE_SETS = {
    "plain": [],
    "tiny": TINY,
    "ddp": [*TINY, "training.backend=ddp", "collaboration.target_batch_size=64", "training.local_batch_size=16"],
    "single_dpu": ["training.backend=single", "collaboration.semantics=dpu"],
    "diloco": ["collaboration.semantics=diloco", "collaboration.inner_steps=2"],
    "fp16_cpu": ["training.precision=fp16", "debug.fp16_on_cpu=true"],
    "outputs": ["training.output_dir=outputs/trainer1", "monitor.checkpoint_every_steps=5"],
}
NON_RUN_CONFIGS = ("network", "setups")  # other schemas, loaded by their tools


def dump_run_configs(out: Path) -> int:
    import torch

    from common.config import load_config, to_yaml
    from common.errors import ConfigError

    try:  # after the refactor: the run context; before it: the loose resolution
        from common.context import RunContext

        def resolved_precision(config) -> str:
            return RunContext.resolve(config, torch.device("cpu")).precision.name

    except ImportError:
        from common.precision import resolve_precision

        def resolved_precision(config) -> str:
            return resolve_precision(config.training.precision, torch.device("cpu"), config.debug.fp16_on_cpu)

    count = 0
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        relative = path.relative_to(ROOT / "configs")
        if relative.parts[0] in NON_RUN_CONFIGS:
            continue
        for name, overrides in OVERRIDE_SETS.items():
            target = out / "configs" / relative.parent / f"{relative.stem}.{name}.txt"
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                config = load_config(path, overrides)
                text = to_yaml(config) + f"# resolved precision on cpu: {resolved_precision(config)}\n"
            except ConfigError as error:
                text = f"ConfigError: {error}\n"
            target.write_text(text)
            count += 1
    return count


def dump_other_configs(out: Path) -> int:
    from common.tools.cost_model import load_setup, load_task_spec
    from common.tools.netns import load_network_setup

    count = 0
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        relative = path.relative_to(ROOT / "configs")
        if relative.parts[0] not in NON_RUN_CONFIGS:
            continue
        if relative.parts[0] == "network":
            loader = load_network_setup
        elif "tasks" in relative.parts:
            loader = load_task_spec
        elif "events" in relative.parts:
            continue  # event traces, read by the replay tool (not part of this refactor)
        else:
            loader = load_setup
        try:
            text = repr(loader(path)) + "\n"
        except Exception as error:  # a loader's own error is part of its behaviour
            text = f"{type(error).__name__}: {error}\n"
        target = out / "configs" / relative.parent / f"{relative.stem}.txt"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        count += 1
    return count


def dump_help(out: Path) -> int:
    scripts = sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "scripts" / "experiments").glob("*.py"))
    for script in scripts:
        result = subprocess.run(
            [sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        target = out / "help" / script.relative_to(ROOT / "scripts").with_suffix(".txt")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"exit {result.returncode}\n{result.stdout}\n--- stderr ---\n{result.stderr}")
    return len(scripts)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to write the snapshot to (created)")
    parser.add_argument("--no-help", action="store_true", help="skip the scripts' --help (one interpreter each)")
    args = parser.parse_args()
    runs, others = dump_run_configs(args.out), dump_other_configs(args.out)
    helps = 0 if args.no_help else dump_help(args.out)
    logger.info(f"{runs} resolved run configs, {others} other configs, {helps} --help texts written to {args.out}")


if __name__ == "__main__":
    main()
