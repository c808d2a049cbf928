"""Every check of the full-scale path on one GPU, in one bounded run (at most ~8 minutes with the defaults):

1. ``loops``: samples/s and peak memory of ALBERT-large (seq 512) and SwAV ResNet-50 (2x224 + 6x96), each in bf16
   and in fp16 with loss scaling, three ways: a plain PyTorch loop, our loop (common/trainer.py, single backend)
   and a collaborative peer (a trainer and an auxiliary peer, separate processes on loopback). Goal: ours >= 0.95
   x plain. The peer's share of its wall time spent computing (the rest: averaging, waiting).
2. ``batch``: the largest local batch that fits in the GPU's memory (doubling, then a few bisections; bounded),
   with samples/s at each size tried.
3. ``pipeline``: SwAV's multi-crop input pipeline alone with 0..N DataLoader workers against the GPU's step rate.
4. ``swarm``: a monitor and 2 trainers of ALBERT-large in bf16 on the one GPU for a few global steps: the steps
   happen, the loss falls, the trainers agree, the monitor checkpoints and exports a Hugging Face folder.

Real offline data only (English Wikipedia leads; Fashion-MNIST images through the same multi-crop recipe). Each
measurement is bounded and the whole run has a time budget (``--budget-seconds``): what no longer fits is recorded
as skipped, never run past the budget. Results are rewritten after every measurement into ``--output-dir``:
device.json, results.json (everything, with the command and date), throughput.csv, batch_search.csv, pipeline.csv,
gpu_checks.png; peer logs and checkpoints go to ``--runs-dir`` (under the ignored outputs/).

  python scripts/experiments/gpu_throughput.py --output-dir paper_results/gpu            # on a CUDA GPU
  python scripts/experiments/gpu_throughput.py --tiny --output-dir outputs/gpu_smoke     # the tiny configs, any CPU
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import psutil
import torch

from common.backends import SingleProcessBackend
from common.config import import_task_module, load_config
from common.context import RunContext
from common.errors import UserError, exit_on_user_error
from common.lifecycle import setup_logging
from common.metrics import HistoryWriter
from common.report import build_report
from common.swarm import LocalSwarm
from common.task import EXPORT_DIR
from common.trainer import Trainer, peak_memory_mb

logger = logging.getLogger("gpu_throughput")

PHASES = ("loops", "batch", "pipeline", "swarm")
PRECISIONS = ("bf16", "fp16")
OFFLINE_ALBERT = ["task.corpus=offline_wikipedia", "task.tokenizer=train", "task.max_documents=20000"]
# name: (config, overrides that keep the paper's model and shapes but read offline data, batch-search cap)
MODELS = {
    "albert_large": ("configs/albert/paper.yaml", OFFLINE_ALBERT, 256),
    "swav_resnet50": ("configs/swav/paper.yaml", ["task.dataset=fashion_mnist", "task.max_images=4096"], 1024),
}
TINY = {
    "albert_large": ("configs/albert/tiny.yaml", ["task.max_documents=600"], 64),
    "swav_resnet50": ("configs/swav/tiny.yaml", ["task.max_images=512"], 128),
}
SWARM_MODEL, PIPELINE_MODEL = "albert_large", "swav_resnet50"
SWARM_TRAINERS = 2
# a swarm of a few steps must see the learning rate act: the paper's 5,000 warmup steps would keep it near zero
SWARM_SCHEDULE = ["task.warmup_steps=2", "task.total_steps=1000"]
LOCAL_SWARM = ["collaboration.matchmaking_time=2.0", "collaboration.averaging_timeout=30.0"]
PEER_STEPS = 3
PEER_START_SECONDS = 75.0  # two peer processes' imports, task, DHT and first steps (twice that on --tiny's CPU)
# CPU autocast has no fast float16 convolutions: the tiny SwAV ran orders of magnitude slower in fp16 than in bf16
CPU_SLOW_FP16 = {"swav_resnet50"}
WARMUP_LIMIT_SECONDS = 120.0  # the plain loop's first optimizer step (allocations, cudnn autotuning), at most
BATCH_SEARCH_STEPS = 3  # timed steps at each batch size (after one that allocates)
BATCH_SEARCH_BISECTIONS = 3


class Budget:
    """The run's wall-clock budget, counted from the process's start (its imports included); a measurement starts
    only if its worst case fits in what is left."""

    def __init__(self, seconds: float, started: Optional[float] = None):
        self.started = psutil.Process().create_time() if started is None else started  # wall-clock seconds
        self.seconds = seconds
        self.skipped: List[str] = []

    def elapsed(self) -> float:
        return time.time() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, what: str, needs: float) -> bool:
        if self.left() >= needs:
            return True
        self.skip(f"{what}: it needs up to {needs:.0f} s and {max(0.0, self.left()):.0f} s are left")
        return False

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        logger.warning(f"skipped {what}")


def largest_fitting(fits: Callable[[int], bool], start: int, cap: int, bisections: int) -> Tuple[int, List[int]]:
    """The largest batch in [start, cap] for which ``fits`` holds, assuming it holds up to some size and not above:
    doubling from ``start``, then at most ``bisections`` halvings of the gap (in multiples of ``start``). Returns
    (largest found, 0 if not even ``start`` fits; the sizes tried in order)."""
    tried: List[int] = []

    def check(size: int) -> bool:
        tried.append(size)
        return fits(size)

    if not check(start):
        return 0, tried
    good, bad = start, None
    while bad is None and good < cap:
        size = min(2 * good, cap)
        if check(size):
            good = size
        else:
            bad = size
    for _ in range(bisections):
        if bad is None or bad - good <= start:
            break
        middle = (good + bad) // 2 // start * start
        if middle <= good:
            break
        good, bad = (middle, bad) if check(middle) else (good, middle)
    return good, tried


# ----------------------------------------------------------------------------------------------- the device


def describe_device(tiny: bool) -> Dict:
    """Name, memory and bf16 support of the GPU (the GPU mode requires one), and the machine around it."""
    facts = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "host": platform.node(),
    }
    if not torch.cuda.is_available():
        if not tiny:
            raise UserError(
                "no CUDA device: torch.cuda.is_available() is false on this machine (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda}); the GPU checks need one (--tiny runs the "
                "tiny configs on a CPU)"
            )
        return {**facts, "device": "cpu", "name": platform.processor() or "cpu", "bf16": True}
    properties = torch.cuda.get_device_properties(0)
    return {
        **facts,
        "device": "cuda",
        "name": properties.name,
        "memory_gib": round(properties.total_memory / 2**30, 2),
        "capability": f"{properties.major}.{properties.minor}",
        "multiprocessors": properties.multi_processor_count,
        "bf16": bool(torch.cuda.is_bf16_supported()),
        "device_count": torch.cuda.device_count(),
    }


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------- loops


def seeded_task(config) -> tuple:
    """The run's task built from torch seed 0 (every loop starts from the same model), and the run context (device
    and precision)."""
    context = RunContext.resolve(config)
    torch.manual_seed(0)
    return import_task_module(config.task_module).build_task(config), context


def plain_loop(config, seconds: float) -> Dict:
    """The baseline: the same model, data stream and optimizer, with nothing of ours around the step; the first
    optimizer step (allocations, cudnn autotuning) is warm-up and not counted."""
    task, context = seeded_task(config)
    device, precision = context.device, context.precision
    model = task.model.to(device).train()
    optimizer = task.make_optimizer(task.optimizer_param_groups())
    scaler = torch.amp.GradScaler(device.type, enabled=precision.loss_scaling)
    accumulate = config.collaboration.target_batch_size // config.training.local_batch_size
    batches = task.batch_stream(0, config.training.dataloader_workers, device.type == "cuda")
    samples, micro_batches, started, warm = 0, 0, time.perf_counter(), None
    while warm is None or time.perf_counter() - warm < seconds:
        if warm is None and time.perf_counter() - started > WARMUP_LIMIT_SECONDS:
            raise TimeoutError(f"no optimizer step within {WARMUP_LIMIT_SECONDS:.0f} s")
        batch = {name: value.to(device, non_blocking=True) for name, value in next(batches).items()}
        with precision.autocast(device):
            output = task.forward(model, batch)
        scaler.scale(output.loss / accumulate).backward()
        micro_batches += 1
        if warm is not None:
            samples += output.batch_size
        if micro_batches % accumulate == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if warm is None:
                synchronize(device)
                warm = time.perf_counter()
    synchronize(device)
    elapsed = time.perf_counter() - warm
    getattr(batches, "close", lambda: None)()  # stops DataLoader workers
    return {
        "samples_per_second": samples / elapsed,
        "steady_samples_per_second": samples / elapsed,
        "warmup_seconds": warm - started,
        "peak_memory_mb": peak_memory_mb(device),
        "precision": precision,
    }


def steady_rate(steps_log: Path) -> Optional[float]:
    """This process's samples/s from the end of its first global step to the end of its last (warm-up left out)."""
    if not steps_log.exists():
        return None
    records = [json.loads(line) for line in steps_log.read_text().splitlines() if line.strip()]
    if len(records) < 2:
        return None
    seconds = records[-1]["time"] - records[0]["time"]
    return sum(record["samples"] for record in records[1:]) / seconds if seconds > 0 else None


def our_single(config, seconds: float, output_dir: Path) -> Dict:
    task, context = seeded_task(config)
    precision = context.precision
    task.model.to(context.device)
    backend = SingleProcessBackend(task, config.collaboration, precision)
    # the loop's limits are this measurement's; the rest (loader workers, non-finite policy) the config's
    training = dataclasses.replace(
        config.training, max_global_steps=10**9, max_wall_seconds=seconds, log_every_seconds=max(30.0, seconds)
    )
    trainer = Trainer(task, backend, training, context, peer_name="single", stream_seed=0, output_dir=output_dir)
    summary = trainer.run()
    return {
        "samples_per_second": summary.samples_per_second,
        "steady_samples_per_second": steady_rate(output_dir / "steps.jsonl"),
        "compute_share": summary.compute_seconds / summary.wall_seconds,
        "peak_memory_mb": summary.peak_memory_mb,
        "global_steps": summary.global_steps,
        "precision": precision,
    }


def our_peer(config_path: str, overrides: List[str], wall_limit: float, output_dir: Path, timeout: float) -> Dict:
    """One trainer and one auxiliary peer (separate processes on loopback); the trainer's own summary. The auxiliary
    peer starts first, so that it takes its share of every averaging round from the trainer's first step on. The
    trainer runs PEER_STEPS global steps (``wall_limit`` seconds at most): a rate after its first step needs two."""
    swarm_overrides = [
        *overrides,
        f"training.max_global_steps={PEER_STEPS}",
        f"training.max_wall_seconds={wall_limit}",
        "collaboration.final_averaging_seconds=0",  # the end-of-run round with other trainers: there are none
        "monitor.wandb_mode=disabled",
    ]
    with LocalSwarm(config_path, output_dir, swarm_overrides) as swarm:
        swarm.start_first_peer("auxiliary", "aux0", timeout=timeout)
        swarm.start("trainer", "trainer0")
        if not swarm.wait(["trainer0"], timeout=timeout):
            raise TimeoutError(
                f"the trainer did not finish within {timeout:.0f} s: {swarm.peers['trainer0'].log_tail()}"
            )
        swarm.stop_many(["aux0"])
        auxiliary_exit_code = swarm.peers["aux0"].process.returncode
    summary_path = output_dir / "trainer0" / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"the trainer left no summary: see {output_dir / 'trainer0' / 'peer.log'}")
    summary = json.loads(summary_path.read_text())
    return {
        "samples_per_second": summary["samples_per_second"],
        "steady_samples_per_second": steady_rate(output_dir / "trainer0" / "steps.jsonl"),
        "compute_share": summary["compute_seconds"] / summary["wall_seconds"],
        "peak_memory_mb": summary["peak_memory_mb"],
        "global_steps": summary["global_steps"],
        "overflow_discards": summary.get("overflow_discards", 0),
        "auxiliary_exit_code": auxiliary_exit_code,  # 0: it was up and stopped cleanly
    }


# ----------------------------------------------------------------------------------------------- batch search


def repeated(batch: Dict[str, torch.Tensor], times: int) -> Dict[str, torch.Tensor]:
    """A batch ``times`` as large (the same samples repeated): the memory and compute of that batch size."""
    return {
        name: value.repeat(times, *[1] * (value.dim() - 1)) if value.dim() > 0 else value
        for name, value in batch.items()
    }


def batch_search(config, cap: int, deadline: float) -> Dict:
    """The largest local batch (a multiple of the config's) whose forward, backward and optimizer step fit in the
    device's memory, under the config's precision; samples/s at each size tried."""
    task, context = seeded_task(config)
    device, precision = context.device, context.precision
    model = task.model.to(device).train()
    optimizer = task.make_optimizer(task.optimizer_param_groups())
    scaler = torch.amp.GradScaler(device.type, enabled=precision.loss_scaling)
    base = next(task.batch_stream(0))
    start = int(base["sample_ids"].shape[0])
    rows = []

    def fits(size: int) -> bool:
        if time.monotonic() > deadline:
            rows.append({"batch": size, "fits": None, "samples_per_second": None, "peak_memory_mb": None})
            return False
        free_device_memory()
        batch = {name: value.to(device) for name, value in repeated(base, size // start).items()}
        try:
            for index in range(1 + BATCH_SEARCH_STEPS):
                if index == 1:
                    synchronize(device)
                    tick = time.perf_counter()
                with precision.autocast(device):
                    output = task.forward(model, batch)
                scaler.scale(output.loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            rate = size * BATCH_SEARCH_STEPS / (time.perf_counter() - tick)
            rows.append(
                {"batch": size, "fits": True, "samples_per_second": rate, "peak_memory_mb": peak_memory_mb(device)}
            )
            return True
        except torch.OutOfMemoryError:
            rows.append({"batch": size, "fits": False, "samples_per_second": None, "peak_memory_mb": None})
            return False
        finally:
            del batch
            optimizer.zero_grad(set_to_none=True)
            free_device_memory()

    largest, _ = largest_fitting(fits, start, cap, BATCH_SEARCH_BISECTIONS)
    return {"precision": precision, "config_batch": start, "cap": cap, "largest": largest, "tried": rows}


# ----------------------------------------------------------------------------------------------- pipeline


def pipeline_check(config, workers: Sequence[int], seconds: float) -> Dict:
    """SwAV's batch stream alone with each worker count, against forward + backward alone on the device."""
    from input_pipeline_benchmark import model_step_rate, pipeline_rate  # a sibling script: scripts/experiments

    task, context = seeded_task(config)
    device, precision = context.device, context.precision
    step = model_step_rate(task, device, precision, seconds)
    rates = {}
    for count in workers:
        rates[count] = pipeline_rate(task, count, seconds, device.type == "cuda")
        logger.info(f"pipeline: {count} workers {rates[count]:.1f} samples/s (the model's step: {step:.1f})")
    enough = [count for count in workers if rates[count] >= step]
    return {
        "precision": precision,
        "local_batch_size": config.training.local_batch_size,
        "model_step_samples_per_second": step,
        "pipeline_samples_per_second": {str(count): rate for count, rate in rates.items()},
        "workers_needed": min(enough) if enough else None,  # None: no count tried keeps up
        "cpu_cores": os.cpu_count(),
    }


# ----------------------------------------------------------------------------------------------- swarm


def swarm_check(config_path: str, overrides: List[str], steps: int, run_dir: Path, timeout: float) -> Dict:
    """A monitor and SWARM_TRAINERS trainers on this machine (one GPU), a few global steps, then the run's report
    (loss per step, agreement) and the monitor's checkpoint and export."""
    config = load_config(config_path, overrides)
    trainers = [f"trainer{index}" for index in range(SWARM_TRAINERS)]
    started = time.time()
    with LocalSwarm(config_path, run_dir, overrides) as swarm:
        swarm.start_first_peer("monitor", "monitor", timeout=timeout)
        for name in trainers:
            swarm.start("trainer", name)
        finished = swarm.wait(trainers, timeout=max(1.0, timeout - (time.time() - started)), tick_seconds=15)
        if not finished:
            logger.warning(f"the swarm's trainers did not finish within {timeout:.0f} s: stopping them")
        swarm.stop_many(trainers)
        time.sleep(2 * config.monitor.refresh_seconds + 1)  # the monitor records the last steps
        swarm.stop_many(["monitor"])
        exit_codes = {name: peer.process.returncode for name, peer in swarm.peers.items()}
    report = build_report(
        run_dir, trainers, "monitor", time.time() - started, config.collaboration.agreement_tolerance
    )
    history = HistoryWriter(run_dir / "monitor").read()
    export = run_dir / "monitor" / EXPORT_DIR
    checkpoints = sorted(path.name for path in (run_dir / "monitor" / "checkpoints").glob("step_*.pt"))
    return {
        "finished": finished,
        "exit_codes": exit_codes,
        "target_batch_size": config.collaboration.target_batch_size,
        "global_steps": report["global_steps"],
        "loss_per_step": [[entry["step"], entry["loss"], entry["peers"]] for entry in history],
        "loss_first": report["loss_first"],
        "loss_last": report["loss_last"],
        "loss_fell": report["loss_first"] is not None and report["loss_last"] < report["loss_first"],
        "max_param_diff": report["max_param_diff"],
        "params_agree": report["params_agree"],
        "agreement_tolerance": report["agreement_tolerance"],
        "samples_per_second": report["samples_per_second"],
        "checkpoints": checkpoints,
        "exported": sorted(path.name for path in export.iterdir()) if export.is_dir() else [],
        "wall_seconds": report["wall_seconds"],
    }


# ----------------------------------------------------------------------------------------------- output


class Results:
    """results.json and the CSV/PNG beside it, rewritten after every measurement (a killed run keeps its part)."""

    def __init__(self, output_dir: Path, header: Dict):
        self.output_dir, self.data = output_dir, {**header, "loops": {}, "batch_search": {}, "skipped": []}
        output_dir.mkdir(parents=True, exist_ok=True)

    def save(self, budget: Budget) -> None:
        self.data["skipped"] = list(budget.skipped)
        self.data["elapsed_seconds"] = round(budget.elapsed(), 1)
        (self.output_dir / "results.json").write_text(json.dumps(self.data, indent=2))
        self._write_csvs()

    def _write_csvs(self) -> None:
        rows = []
        for model, by_precision in self.data["loops"].items():
            for precision, loops in by_precision.items():
                for loop, values in loops.items():
                    rows.append({"model": model, "precision": precision, "loop": loop, **values})
        columns = [
            "model",
            "precision",
            "loop",
            "local_batch_size",
            "target_batch_size",
            "samples_per_second",
            "steady_samples_per_second",
            "vs_plain",
            "compute_share",
            "peak_memory_mb",
            "global_steps",
            "error",
        ]
        _write_csv(self.output_dir / "throughput.csv", columns, rows)
        batch_rows = [
            {"model": model, "precision": search["precision"], **row}
            for model, search in self.data["batch_search"].items()
            for row in search.get("tried", [])
        ]
        _write_csv(
            self.output_dir / "batch_search.csv",
            ["model", "precision", "batch", "fits", "samples_per_second", "peak_memory_mb"],
            batch_rows,
        )
        pipeline = self.data.get("pipeline") or {}
        step = pipeline.get("model_step_samples_per_second")
        _write_csv(
            self.output_dir / "pipeline.csv",
            ["workers", "pipeline_samples_per_second", "model_step_samples_per_second", "pipeline_over_step"],
            [
                {
                    "workers": workers,
                    "pipeline_samples_per_second": rate,
                    "model_step_samples_per_second": step,
                    "pipeline_over_step": rate / step if step else None,
                }
                for workers, rate in pipeline.get("pipeline_samples_per_second", {}).items()
            ],
        )

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(2, 2, figsize=(12, 8))
        bars, labels = [], []
        for model, by_precision in self.data["loops"].items():
            for precision, loops in by_precision.items():
                for loop, values in loops.items():
                    bars.append(values.get("steady_samples_per_second") or values.get("samples_per_second") or 0)
                    labels.append(f"{model}\n{precision} {loop}")
        axes[0, 0].barh(range(len(bars)), bars)
        axes[0, 0].set_yticks(range(len(bars)), labels, fontsize=6)
        axes[0, 0].set_xlabel("samples/s (after the first global step; whole run if under 2 steps)")
        axes[0, 0].set_title("plain PyTorch vs our loop vs a collaborative peer")
        for model, search in self.data["batch_search"].items():
            points = [(row["batch"], row["samples_per_second"]) for row in search.get("tried", []) if row["fits"]]
            if points:
                axes[0, 1].plot(*zip(*sorted(points)), marker="o", label=f"{model} ({search['precision']})")
        axes[0, 1].set_xscale("log", base=2)
        axes[0, 1].set_xlabel("local batch")
        axes[0, 1].set_ylabel("samples/s")
        axes[0, 1].set_title("batch sizes that fit (forward + backward + step)")
        if axes[0, 1].lines:
            axes[0, 1].legend(fontsize=7)
        pipeline = self.data.get("pipeline") or {}
        if pipeline.get("pipeline_samples_per_second"):
            workers = [int(count) for count in pipeline["pipeline_samples_per_second"]]
            axes[1, 0].plot(workers, list(pipeline["pipeline_samples_per_second"].values()), marker="o", label="input")
            axes[1, 0].axhline(pipeline["model_step_samples_per_second"], color="red", label="model step")
            axes[1, 0].legend(fontsize=7)
        axes[1, 0].set_xlabel("DataLoader workers")
        axes[1, 0].set_ylabel("samples/s")
        axes[1, 0].set_title("SwAV multi-crop input vs the model's step")
        swarm = self.data.get("swarm") or {}
        if swarm.get("loss_per_step"):
            steps, losses, _ = zip(*swarm["loss_per_step"])
            axes[1, 1].plot(steps, losses, marker="o")
        axes[1, 1].set_xlabel("global step")
        axes[1, 1].set_ylabel("loss")
        axes[1, 1].set_title(f"{SWARM_TRAINERS}-trainer swarm on one device")
        figure.suptitle(f"{self.data['device']['name']} ({self.data['date']})")
        figure.tight_layout()
        figure.savefig(self.output_dir / "gpu_checks.png", dpi=110)
        plt.close(figure)


def _write_csv(path: Path, columns: List[str], rows: List[Dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# ----------------------------------------------------------------------------------------------- main


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny configs (a CPU smoke run of the same path)")
    parser.add_argument("--output-dir", default="outputs/gpu_checks", help="results (6 files)")
    parser.add_argument(
        "--runs-dir",
        default="outputs/gpu_checks_runs",
        help="peer logs and checkpoints (its loops/ and swarm/ are emptied first: a monitor would resume them)",
    )
    parser.add_argument("--budget-seconds", type=float, default=None, help="whole run (default 450; --tiny 420)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="measured seconds of the plain loop and ours (default 8; tiny 4)"
    )
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per global step in the loops")
    parser.add_argument(
        "--peer-step-seconds",
        type=float,
        default=None,
        help="the peer's target batch: about this many seconds of its compute at our loop's rate (default 4; tiny 2)",
    )
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--loops", nargs="+", choices=("plain", "single", "peer"), default=["plain", "single", "peer"])
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="pipeline (default 0 2 4 8 12; tiny 0 1)")
    parser.add_argument(
        "--fashion-mnist-dir",
        default=None,
        help="where the Fashion-MNIST IDX files are (default: the Debian package's)",
    )
    parser.add_argument("--swarm-steps", type=int, default=None, help="global steps of the swarm (default 6; tiny 4)")
    args = parser.parse_args(argv)
    defaults = {
        "budget_seconds": (420.0, 450.0),
        "seconds": (4.0, 8.0),
        "peer_step_seconds": (2.0, 4.0),
        "workers": ([0, 1], [0, 2, 4, 8, 12]),
        "swarm_steps": (4, 6),
    }
    for name, (tiny, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.budget_seconds <= 0 or args.seconds <= 0 or args.accumulate < 1 or args.swarm_steps < 2:
        raise UserError("--budget-seconds and --seconds must be > 0, --accumulate >= 1 and --swarm-steps >= 2")
    if any(count < 0 for count in args.workers):
        raise UserError("--workers must be >= 0")
    return args


def _raise_interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)  # unwinds through LocalSwarm, which stops its peers


def model_overrides(args, name: str, precision: str, local_batch: Optional[int] = None) -> Tuple[str, List[str]]:
    config_path, overrides, _ = (TINY if args.tiny else MODELS)[name]
    if args.fashion_mnist_dir and name == "swav_resnet50":
        overrides = [*overrides, f"task.fashion_mnist_dir={args.fashion_mnist_dir}"]
    base = load_config(config_path, overrides)
    local = local_batch or base.training.local_batch_size
    return config_path, [
        *overrides,
        f"training.precision={precision}",
        *(["debug.fp16_on_cpu=true"] if not torch.cuda.is_available() else []),
        f"training.local_batch_size={local}",
        f"collaboration.target_batch_size={local * args.accumulate}",
        *(["training.dataloader_workers=0"] if args.tiny else []),
        "collaboration.expected_peers=1",
        f"collaboration.run_id=gpu_checks_{name}_{precision}",
        *LOCAL_SWARM,
    ]


def run_loops(args, results: Results, budget: Budget, precisions: List[str], runs: Path, loops: Sequence[str]) -> None:
    for name in args.models:
        for precision in precisions:
            if precision == "fp16" and name in CPU_SLOW_FP16 and not torch.cuda.is_available():
                budget.skip(f"loops/{name}/fp16/{'+'.join(loops)}: fp16 convolutions on a CPU take minutes per step")
                continue
            config_path, overrides = model_overrides(args, name, precision)
            config = load_config(config_path, overrides)
            row = results.data["loops"].setdefault(name, {}).setdefault(precision, {})
            common = {
                "local_batch_size": config.training.local_batch_size,
                "target_batch_size": config.collaboration.target_batch_size,
            }
            # a loop's worst case: building the task (data, tokenizer from cache) and its measured seconds
            if "plain" in loops and budget.allows(f"loops/{name}/{precision}/plain", args.seconds + 60):
                logger.info(f"{name} {precision}: plain PyTorch loop, {args.seconds:.0f} s")
                row["plain"] = {**common, **_guarded(plain_loop, config, args.seconds)}
                free_device_memory()
                results.save(budget)
            if "single" in loops and budget.allows(f"loops/{name}/{precision}/single", args.seconds + 60):
                logger.info(f"{name} {precision}: our loop (single backend), {args.seconds:.0f} s")
                row["single"] = {
                    **common,
                    **_guarded(our_single, config, args.seconds, runs / name / precision / "single"),
                }
                free_device_memory()
                results.save(budget)
            # its steps take about peer_step_seconds each (the target batch below) plus an averaging round
            peer_seconds, peer_start = PEER_STEPS * (args.peer_step_seconds + 2), PEER_START_SECONDS
            peer_start *= 2 if args.tiny else 1
            if "peer" in loops and budget.allows(f"loops/{name}/{precision}/peer", peer_seconds + peer_start):
                rate = (row.get("single") or {}).get("steady_samples_per_second") or (row.get("plain") or {}).get(
                    "steady_samples_per_second"
                )
                local = config.training.local_batch_size
                target = max(
                    local * args.accumulate, int(rate * args.peer_step_seconds) // local * local if rate else 0
                )
                peer_overrides = [*overrides, f"collaboration.target_batch_size={target}"]
                logger.info(f"{name} {precision}: a collaborative peer + an auxiliary peer, target batch {target}")
                wall_limit = 3 * peer_seconds
                timeout = min(budget.left(), wall_limit + peer_start)
                row["peer"] = {
                    **common,
                    "target_batch_size": target,
                    **_guarded(
                        our_peer, config_path, peer_overrides, wall_limit, runs / name / precision / "peer", timeout
                    ),
                }
                results.save(budget)
            plain = (row.get("plain") or {}).get("steady_samples_per_second")
            for loop in ("single", "peer"):
                mine = (row.get(loop) or {}).get("steady_samples_per_second")
                if plain and mine:
                    row[loop]["vs_plain"] = mine / plain
            logger.info(f"{name} {precision}: {json.dumps(row)}")
            results.save(budget)


def _guarded(function: Callable, *arguments) -> Dict:
    """One measurement; its failure (out of memory, a peer that did not finish) is recorded and the run goes on."""
    try:
        return function(*arguments)
    except (RuntimeError, TimeoutError, UserError) as error:
        logger.error(
            f"{function.__name__} failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
        )
        free_device_memory()
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]}


def cost_model_rates(results: Dict, precision: str) -> Dict[str, float]:
    """Per task spec (configs/setups/tasks), samples/s of our loop in ``precision`` after its first global step (its
    whole run's rate if it made fewer than two steps): the per-machine compute throughput the cost model's setups
    take (common/tools/cost_model.py)."""
    rates = {}
    for name, by_precision in results["loops"].items():
        single = by_precision.get(precision, {}).get("single") or {}
        rate = single.get("steady_samples_per_second") or single.get("samples_per_second")
        if rate:
            rates[name] = rate
    return rates


@exit_on_user_error
def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_arguments(argv)
    setup_logging("gpu_throughput")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    budget = Budget(args.budget_seconds)
    device = describe_device(args.tiny)
    logger.info(f"device: {json.dumps(device)}")
    output_dir, runs = Path(args.output_dir), Path(args.runs_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output-dir {output_dir} is a file, not a folder")
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "device.json").write_text(json.dumps(device, indent=2))
    for stale in (runs / "loops", runs / "swarm"):  # step logs append and a monitor resumes its history
        shutil.rmtree(stale, ignore_errors=True)
    precisions = [precision for precision in args.precisions if precision != "bf16" or device["bf16"]]
    if len(precisions) < len(args.precisions):
        budget.skip(f"bf16: {device['name']} has no bfloat16")
    preferred = "bf16" if "bf16" in precisions else precisions[0]
    results = Results(
        output_dir,
        {
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "date": device["date"],
            "device": device,
            "tiny": args.tiny,
            "configs": {name: (TINY if args.tiny else MODELS)[name][0] for name in args.models},
            "budget_seconds": args.budget_seconds,
            "seconds_per_loop": args.seconds,
            "accumulate": args.accumulate,
        },
    )
    results.save(budget)
    torch.set_num_threads(load_config(*model_overrides(args, args.models[0], preferred)).training.num_threads)
    # the phases in order of what the issue needs most; the peers (processes, the slowest to start) come last and
    # the fp16 peers after the bf16 ones, so that a short budget skips the least
    if "loops" in args.phases:
        run_loops(args, results, budget, precisions, runs / "loops", [loop for loop in args.loops if loop != "peer"])
    if "swarm" in args.phases and budget.allows("swarm", 150):
        config_path, overrides = model_overrides(args, SWARM_MODEL, preferred)
        local = load_config(config_path, overrides).training.local_batch_size
        overrides += [
            f"collaboration.target_batch_size={local * SWARM_TRAINERS * args.accumulate}",
            f"collaboration.expected_peers={SWARM_TRAINERS}",
            f"collaboration.run_id=gpu_checks_swarm_{preferred}",
            f"training.max_global_steps={args.swarm_steps}",
            "training.max_wall_seconds=null",
            f"monitor.checkpoint_every_steps={max(1, args.swarm_steps // 2)}",
            "monitor.wandb_mode=disabled",
            "monitor.refresh_seconds=1.0",
            *([] if args.tiny else SWARM_SCHEDULE),
        ]
        logger.info(f"{SWARM_MODEL} {preferred}: a monitor and {SWARM_TRAINERS} trainers, {args.swarm_steps} steps")
        swarm_timeout = min(budget.left() - 10, 400.0 if args.tiny else 240.0)
        results.data["swarm"] = {
            "precision": preferred,
            **_guarded(swarm_check, config_path, overrides, args.swarm_steps, runs / "swarm", swarm_timeout),
        }
        results.save(budget)
    if "pipeline" in args.phases and budget.allows("pipeline", args.seconds * (len(args.workers) + 1) + 90):
        config = load_config(*model_overrides(args, PIPELINE_MODEL, preferred))
        logger.info(f"{PIPELINE_MODEL}: input pipeline with {args.workers} workers vs the model's step")
        results.data["pipeline"] = _guarded(pipeline_check, config, args.workers, args.seconds)
        free_device_memory()
        results.save(budget)
    if "batch" in args.phases:
        for name in args.models:
            if budget.allows(f"batch/{name}", 40):
                config = load_config(*model_overrides(args, name, preferred))
                deadline = time.monotonic() + min(60.0 if args.tiny else 30.0, budget.left() - 10)
                cap = (TINY if args.tiny else MODELS)[name][2]
                logger.info(f"{name} {preferred}: the largest local batch that fits (up to {cap})")
                results.data["batch_search"][name] = _guarded(batch_search, config, cap, deadline)
                free_device_memory()
                results.save(budget)
    if "loops" in args.phases and "peer" in args.loops:
        ordered = sorted(precisions, key=lambda precision: precision != preferred)
        for precision in ordered:
            run_loops(args, results, budget, [precision], runs / "loops", ["peer"])
    results.data["cost_model"] = {
        "precision": preferred,
        "loop": "single",
        "device": device["name"],
        "samples_per_second": cost_model_rates(results.data, preferred),
    }
    results.save(budget)
    results.plot()
    logger.info(
        f"done in {budget.elapsed():.0f} s (budget {args.budget_seconds:.0f} s); skipped: "
        f"{budget.skipped or 'nothing'}; wrote {output_dir}"
    )


if __name__ == "__main__":
    main()
