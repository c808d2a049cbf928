#!/usr/bin/env bash
# Set up (same as the demo), lint and format check (ruff), then the whole test suite, multi-peer tests included.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest tests "$@"
