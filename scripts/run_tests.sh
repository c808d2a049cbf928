#!/usr/bin/env bash
# Set up (same as the demo), lint and format check (ruff), then the whole test suite, multi-peer tests included.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# One test process by default. `-n 4` runs whole files on 4 processes (--dist loadfile, the longest first:
# tests/conftest.py): the fast tier in ~3 minutes, the whole suite in ~25 instead of ~50, but under that load the
# timing of test_newcomers_go_on_from_the_last_checkpoint_when_every_trainer_crashed failed once in two runs.
exec .venv/bin/python -m pytest tests -n 0 --dist loadfile "$@"
