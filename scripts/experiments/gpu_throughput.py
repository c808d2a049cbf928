"""Training throughput (samples/s) and peak memory of the paper's models, three ways on one machine:

1. ``plain``: a plain PyTorch loop (autocast, loss scaler, optimizer step every ``--accumulate`` micro-batches);
2. ``single``: our training loop (common/trainer.py) with the single-process backend;
3. ``peer``: our loop as one collaborative hivemind peer, with an auxiliary peer on loopback (real processes).

Models: ALBERT-large at sequence length 512 (configs/albert/paper.yaml) and SwAV ResNet-50 with 2x224 + 6x96
crops (configs/swav/paper.yaml), both on real offline data (English Wikipedia, Fashion-MNIST images upscaled by
the same multi-crop recipe). The goal is ``single`` and ``peer`` >= 0.95 x ``plain``. Each measurement is bounded
by ``--seconds``, so the whole script takes about 8 minutes on one GPU with the defaults.

  python scripts/experiments/gpu_throughput.py --output paper_results/cost/gpu_throughput.json
  python scripts/experiments/gpu_throughput.py --tiny --seconds 10   # the tiny configs on a CPU (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (puts the repository on sys.path)
import torch

from common.backends import SingleProcessBackend
from common.config import import_task_module, load_config
from common.lifecycle import setup_logging
from common.peer import device_for
from common.precision import autocast, resolve_precision
from common.swarm import LocalSwarm
from common.trainer import Trainer, peak_memory_mb

logger = logging.getLogger("gpu_throughput")

MODELS = {
    # config, overrides that keep the paper's model and shapes but read offline data
    "albert_large": (
        "configs/albert/paper.yaml",
        ["task.corpus=offline_wikipedia", "task.tokenizer=train", "task.vocab_size=30000", "task.max_documents=20000"],
    ),
    "swav_resnet50": ("configs/swav/paper.yaml", ["task.dataset=fashion_mnist", "task.max_images=4096"]),
}
TINY = {
    "albert_tiny": ("configs/albert/tiny.yaml", ["task.max_documents=600"]),
    "swav_tiny": ("configs/swav/tiny.yaml", ["task.max_images=512"]),
}


def seeded_task(config) -> tuple:
    """The run's task built from torch seed 0 (every loop starts from the same model), the device it trains on and
    the precision it trains at."""
    device = device_for(config)
    precision = resolve_precision(config.training.precision, device)
    torch.manual_seed(0)
    return import_task_module(config.task_module).build_task(config), device, precision


def plain_loop(config, seconds: float, accumulate: int) -> dict:
    """The baseline: the same model, data stream and optimizer, with nothing of ours around the step."""
    task, device, precision = seeded_task(config)
    model = task.model.to(device).train()
    optimizer = task.make_optimizer(task.optimizer_param_groups())
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    batches = task.batch_stream(0, config.training.dataloader_workers, device.type == "cuda")
    samples, micro_batches, started = 0, 0, None
    while started is None or time.perf_counter() - started < seconds:
        batch = {name: value.to(device, non_blocking=True) for name, value in next(batches).items()}
        with autocast(device, precision):
            output = task.forward(model, batch)
        scaler.scale(output.loss / accumulate).backward()
        micro_batches += 1
        if micro_batches % accumulate == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if started is None:  # the first step (allocations, cudnn autotuning) is warm-up
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                continue
        if started is not None:
            samples += output.batch_size
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"samples_per_second": samples / (time.perf_counter() - started), "peak_memory_mb": peak_memory_mb(device)}


def our_single(config, seconds: float, output_dir: Path) -> dict:
    task, device, precision = seeded_task(config)
    task.model.to(device)
    backend = SingleProcessBackend(task, config.collaboration.target_batch_size, precision=precision)
    trainer = Trainer(
        task,
        backend,
        peer_name="single",
        stream_seed=0,
        max_global_steps=10**9,
        max_wall_seconds=seconds,
        output_dir=output_dir,
        device=device,
        precision=precision,
        dataloader_workers=config.training.dataloader_workers,
        log_every_seconds=60,
    )
    summary = trainer.run()
    return {"samples_per_second": summary.samples_per_second, "peak_memory_mb": summary.peak_memory_mb}


def our_peer(config_path: str, overrides: list, seconds: float, output_dir: Path) -> dict:
    """One trainer and one auxiliary peer (separate processes, loopback); the trainer's own summary."""
    swarm_overrides = [*overrides, f"training.max_wall_seconds={seconds}", "monitor.wandb_mode=disabled"]
    with LocalSwarm(config_path, output_dir, swarm_overrides) as swarm:
        swarm.start_first_peer("trainer", "trainer0")
        swarm.start("auxiliary", "aux0")
        if not swarm.wait(["trainer0"], timeout=seconds + 240):
            raise RuntimeError(f"the trainer did not finish: {swarm.peers['trainer0'].log_tail()}")
        swarm.stop_many(["aux0"])
    summary = json.loads((output_dir / "trainer0" / "summary.json").read_text())
    return {key: summary[key] for key in ("samples_per_second", "peak_memory_mb")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny configs (runs on a CPU)")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per model and loop")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--workers", type=int, default=4, help="training.dataloader_workers (0 on --tiny)")
    parser.add_argument("--output", default="outputs/gpu_throughput.json")
    parser.add_argument("--runs", default="outputs/gpu_throughput_runs")
    args = parser.parse_args()
    setup_logging("gpu_throughput")
    results = {"date": time.strftime("%Y-%m-%d"), "device": _device_name(), "seconds": args.seconds, "models": {}}
    for name, (config_path, model_overrides) in (TINY if args.tiny else MODELS).items():
        runs = Path(args.runs) / name
        local_batch = load_config(config_path, model_overrides).training.local_batch_size
        overrides = [
            *model_overrides,
            f"collaboration.target_batch_size={local_batch * args.accumulate}",
            f"training.dataloader_workers={0 if args.tiny else args.workers}",
            "collaboration.expected_peers=1",
            "collaboration.run_id=throughput",
            "training.log_every_seconds=30",
        ]
        config = load_config(config_path, overrides)
        row = {
            "plain": plain_loop(config, args.seconds, args.accumulate),
            "single": our_single(config, args.seconds, runs / "single"),
            "peer": our_peer(config_path, overrides, args.seconds, runs / "peer"),
        }
        for loop in ("single", "peer"):
            row[loop]["vs_plain"] = row[loop]["samples_per_second"] / row["plain"]["samples_per_second"]
        results["models"][name] = row
        logger.info(f"{name}: {json.dumps(row)}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    logger.info(f"wrote {args.output}")


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
