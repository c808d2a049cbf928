"""The end-of-run report of a local swarm: summary.json, a loss-curve PNG and a short text table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import torch

from common.metrics import HistoryWriter, contributor_labels
from common.roles.trainer import FINAL_STATE_FILE, SUMMARY_FILE

NOT_AVERAGED = ("running_mean", "running_var", "num_batches_tracked", "position_ids", "token_type_ids")


def max_parameter_difference(state_paths: List[Path]) -> Optional[float]:
    """Largest absolute difference of any trained parameter between any trainer and the first one.

    Buffers that hivemind does not average (BatchNorm running statistics, index buffers) are left out.
    """
    if len(state_paths) < 2:
        return None
    reference = torch.load(state_paths[0], map_location="cpu")
    largest = 0.0
    for path in state_paths[1:]:
        other = torch.load(path, map_location="cpu")
        for name, tensor in reference.items():
            if tensor.is_floating_point() and not name.endswith(NOT_AVERAGED):
                largest = max(largest, float((tensor - other[name]).abs().max()))
    return largest


def loss_components(history: List[dict]) -> List[str]:
    """The task's partial losses (metrics named ``*_loss``), plotted beside the total."""
    return sorted(name for name in (history[0]["metrics"] if history else {}) if name.endswith("_loss"))


def quality_metrics(metrics: Dict[str, float]) -> List[str]:
    """The task's other metrics (accuracies and the like), reported first -> last."""
    return sorted(name for name in metrics if not name.endswith("_loss"))


def plot_history(history: List[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [entry["step"] for entry in history]
    figure, (loss_axis, peers_axis) = plt.subplots(
        2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    loss_axis.plot(steps, [entry["loss"] for entry in history], marker="o", label="total loss")
    for metric in loss_components(history):
        loss_axis.plot(steps, [entry["metrics"].get(metric) for entry in history], label=metric, alpha=0.7)
    loss_axis.set_ylabel("loss (sample-weighted over peers)")
    loss_axis.set_title(title)
    loss_axis.legend()
    loss_axis.grid(alpha=0.3)
    peers_axis.step(steps, [entry["peers"] for entry in history], where="mid")
    peers_axis.set_ylabel("trainers")
    peers_axis.set_xlabel("global step")
    peers_axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def swarm_used_share(summaries: Iterable[dict]) -> Optional[float]:
    """Of every sample the trainers computed, the share that entered a global step (None before any)."""
    computed = used = 0
    for summary in summaries:
        computed, used = computed + summary["samples"], used + summary["samples_used"]
    return used / computed if computed else None


def build_report(
    run_dir: Path, trainer_names: List[str], monitor_name: str, wall_seconds: float, agreement_tolerance: float
) -> Dict:
    history = HistoryWriter(run_dir / monitor_name).read()
    summaries = {}
    for name in trainer_names:
        summary_path = run_dir / name / SUMMARY_FILE
        if summary_path.exists():
            summaries[name] = json.loads(summary_path.read_text())
    state_paths = [
        run_dir / name / FINAL_STATE_FILE for name in trainer_names if (run_dir / name / FINAL_STATE_FILE).exists()
    ]
    contributions: Dict[str, int] = {}  # by contributor label: the peer's name, unique (see contributor_labels)
    labels = contributor_labels(history)
    for entry in history:
        for peer_id, samples in entry["contributions"].items():
            contributions[labels[peer_id]] = contributions.get(labels[peer_id], 0) + samples
    difference = max_parameter_difference(state_paths)
    report = {
        "trainers": len(trainer_names),
        "trainers_finished": len(summaries),
        "global_steps": max((summary["global_steps"] for summary in summaries.values()), default=0),
        "steps_recorded": len(history),
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "metrics_first": history[0]["metrics"] if history else {},
        "metrics_last": history[-1]["metrics"] if history else {},
        "peers_per_step": [entry["peers"] for entry in history],
        "max_param_diff": difference,
        "agreement_tolerance": agreement_tolerance,
        "params_agree": None if difference is None else difference <= agreement_tolerance,
        "samples_per_second": {name: summary["samples_per_second"] for name, summary in summaries.items()},
        "samples_contributed": contributions,
        # compute utilisation: the share of computed samples that entered a global step, and of time computing
        "used_share": {name: summary["used_share"] for name, summary in summaries.items()},
        "compute_share": {name: summary["compute_share"] for name, summary in summaries.items()},
        "swarm_used_share": swarm_used_share(summaries.values()),
        "wall_seconds": wall_seconds,
    }
    (run_dir / "summary.json").write_text(json.dumps(report, indent=2))
    if history:
        plot_history(history, run_dir / "loss_curve.png", f"{len(trainer_names)}-trainer collaborative run")
    return report


def format_report(report: Dict) -> str:
    lines = [
        f"trainers: {report['trainers']} (finished: {report['trainers_finished']}), "
        f"global steps: {report['global_steps']}, wall time: {report['wall_seconds']:.0f} s",
        f"loss: {report['loss_first']:.4f} (first step) -> {report['loss_last']:.4f} (last step)"
        if report["loss_first"] is not None
        else "loss: no steps recorded",
    ]
    for name in quality_metrics(report["metrics_last"]):
        if name in report["metrics_first"]:
            lines.append(f"{name}: {report['metrics_first'][name]:.3f} -> {report['metrics_last'][name]:.3f}")
    lines.append(f"trainers per step: {report['peers_per_step']}")
    lines.append("peer         samples  samples/s  used  computing")
    for name in sorted(report["samples_per_second"]):
        lines.append(
            f"{name:<12} {report['samples_contributed'].get(name, 0):>7}  {report['samples_per_second'][name]:>9.1f}"
            f"  {report['used_share'][name]:>4.0%}  {report['compute_share'][name]:>9.0%}"
        )
    if report["swarm_used_share"] is not None:
        lines.append(f"computed samples that entered a global step: {report['swarm_used_share']:.1%}")
    difference = report["max_param_diff"]
    verdict = "same" if report["params_agree"] else "DIFFERENT"
    lines.append(
        "trainers' parameters: "
        + (
            "n/a (fewer than 2 trainers)"
            if difference is None
            else f"max |difference| = {difference:.2e} ({verdict} within {report['agreement_tolerance']:.1e})"
        )
    )
    return "\n".join(lines)
