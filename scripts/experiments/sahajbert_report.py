"""sahajBERT results for ``paper_results/sahajbert/``: the downstream table (published numbers beside ours on the
offline substitutes) and the tiny Bengali MLM run's loss curve from the monitor's per-step history.

  python scripts/experiments/sahajbert_report.py --history outputs/sahajbert_tiny_swarm/monitor/history.jsonl \
      --finetune paper_results/sahajbert/finetune_*.json --output paper_results/sahajbert
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import List

from common.errors import DataError, exit_on_user_error
from common.lifecycle import setup_logging

logger = logging.getLogger(__name__)

# The sahajBERT model card and blog post: mean +- std over 3 fine-tunes.
PUBLISHED = [
    ("sahajBERT (ALBERT-large, 18M params, collaborative)", "95.45 ± 0.53", "91.97 ± 0.47"),
    ("XLM-R-large", "96.48 ± 0.22", "90.05 ± 0.38"),
    ("IndicBERT", "92.52 ± 0.45", "74.46 ± 1.91"),
    ("bnRoBERTa", "82.32 ± 0.67", "80.94 ± 0.45"),
]


def _cell(result: dict) -> str:
    return f"{100 * result['test_mean']:.2f} ± {100 * result['test_std']:.2f} ({result['seeds']} seeds)"


def downstream_table(finetune_files: List[Path]) -> str:
    results = {}
    for path in finetune_files:
        result = json.loads(path.read_text())
        initialisation = "pretrained" if result["checkpoint"] else "random init"
        results[(result["task"], initialisation)] = result
    lines = ["| Model | WikiANN-bn NER F1 | News category accuracy (Soham / IndicGLUE sna.bn) |", "|---|---|---|"]
    lines += [f"| {name} | {ner} | {news} |" for name, ner, news in PUBLISHED]
    lines += [
        "",
        "| Ours, offline SUBSTITUTE tasks (English Wikipedia, not Bengali) | wiki_mentions F1 (WikiANN-style "
        "link-anchor tagging) | wiki_topic accuracy (12 topics) |",
        "|---|---|---|",
    ]
    for initialisation in ("pretrained", "random init"):
        mentions, topic = results.get(("wiki_mentions", initialisation)), results.get(("wiki_topic", initialisation))
        if mentions or topic:
            lines.append(
                f"| tiny ALBERT, {initialisation} | {_cell(mentions) if mentions else 'not run'} | "
                f"{_cell(topic) if topic else 'not run'} |"
            )
    return "\n".join(lines) + "\n"


def loss_curve(history_path: Path, png_path: Path, title: str) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history_path.is_file():
        raise DataError(f"no monitor history at {history_path}")
    history = [json.loads(line) for line in history_path.read_text().splitlines() if line.strip()]
    if not history:
        raise DataError(f"{history_path} has no steps")
    steps = [entry["step"] for entry in history]
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
    loss_axis.plot(steps, [entry["loss"] for entry in history], label="total (MLM + SOP)")
    for metric in ("mlm_loss", "sop_loss"):
        loss_axis.plot(steps, [entry["metrics"].get(metric, float("nan")) for entry in history], label=metric)
    loss_axis.set_xlabel("global step")
    loss_axis.set_ylabel("loss (sample-weighted over peers)")
    loss_axis.legend()
    for metric in ("mlm_accuracy", "sop_accuracy"):
        accuracy_axis.plot(steps, [entry["metrics"].get(metric, float("nan")) for entry in history], label=metric)
    accuracy_axis.set_xlabel("global step")
    accuracy_axis.set_ylabel("accuracy")
    accuracy_axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=120)
    plt.close(figure)
    first, last = history[0], history[-1]
    return {"steps": len(history), "first": first, "last": last}


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--history", required=True, help="monitor/history.jsonl of the Bengali MLM run")
    parser.add_argument("--finetune", nargs="*", default=[], help="JSON files written by scripts/finetune.py")
    parser.add_argument("--output", default="paper_results/sahajbert")
    args = parser.parse_args()
    setup_logging("bengali_report")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    curve = loss_curve(
        Path(args.history),
        output / "bengali_mlm_loss_curve.png",
        "tiny sahajBERT, collaborative, offline Bengali stand-ins (not a pretraining corpus)",
    )
    (output / "bengali_mlm_curve_summary.json").write_text(json.dumps(curve, indent=2) + "\n")
    (output / "downstream_table.md").write_text(downstream_table([Path(path) for path in args.finetune]))
    logger.info(f"wrote {output}/bengali_mlm_loss_curve.png, downstream_table.md ({curve['steps']} steps)")


if __name__ == "__main__":
    main()
