#!/usr/bin/env bash
# The embedded default: set up, then a local collaborative ALBERT run (monitor + 3 trainers + 1 auxiliary peer)
# on offline English Wikipedia. Extra arguments go to scripts/local_swarm.py (e.g. training.max_global_steps=10).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true
exec .venv/bin/python scripts/local_swarm.py --config configs/albert/tiny.yaml --trainers 3 --aux 1 "$@"
