"""Can the input pipeline keep the model busy? Samples/s of the pipeline alone (0, 1, 2 DataLoader workers) against
samples/s of the model's training step alone (forward + backward on batches already built).

The pipeline alone: ``task.batch_stream`` (common/pipeline.py) drained as fast as possible, nothing else running;
for ALBERT that is MLM masking of planned micro-batches, for SwAV decoding and multi-crop augmentation. The model
step: the same task's forward and backward under the run's precision, fed from a few batches built beforehand,
so it costs no input work. When the pipeline's rate is below the step's, a training run waits for data; more
workers (``training.dataloader_workers``) raise the pipeline's rate as long as there are cores to run them.

  python scripts/experiments/input_pipeline_benchmark.py --output paper_results/pipeline/input_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from itertools import islice
from pathlib import Path

import torch

from common.config import load_config
from common.context import RunContext
from common.lifecycle import setup_logging
from common.precision import Precision
from common.task import SAMPLE_IDS

logger = logging.getLogger("input_pipeline_benchmark")

MODELS = {
    "albert_tiny": ("configs/albert/tiny.yaml", ["task.max_documents=3000"]),
    "swav_tiny": ("configs/swav/tiny.yaml", ["task.max_images=2048"]),
}
WARMUP_BATCHES = 3  # the first batches include starting the worker processes and filling their queues
STEP_BATCHES = 4  # batches built beforehand and cycled through by the model-step measurement


def pipeline_rate(task, workers: int, seconds: float, pin_memory: bool) -> float:
    """Samples/s of the task's batch stream with ``workers`` DataLoader processes, nothing else consuming time."""
    stream = task.batch_stream(0, workers, pin_memory)
    try:
        for _ in islice(stream, WARMUP_BATCHES):
            pass
        samples, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            samples += len(next(stream)[SAMPLE_IDS])
        return samples / (time.perf_counter() - started)
    finally:
        getattr(stream, "close", lambda: None)()  # stops the worker processes


def model_step_rate(task, device: torch.device, precision: Precision, seconds: float) -> float:
    """Samples/s of forward + backward alone (the optimizer step, once per global batch, is left out)."""
    model = task.model.to(device).train()
    stream = task.batch_stream(0)
    batches = [{name: value.to(device) for name, value in batch.items()} for batch in islice(stream, STEP_BATCHES)]
    scaler = torch.amp.GradScaler(device.type, enabled=precision.loss_scaling)

    def step(batch) -> int:
        with precision.autocast(device):
            output = task.forward(model, batch)
        scaler.scale(output.loss).backward()
        model.zero_grad(set_to_none=True)
        return output.batch_size

    step(batches[0])  # warm-up: first-call allocations
    samples, index, started = 0, 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        samples += step(batches[index % len(batches)])
        index += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per model and setting")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--output", default="outputs/input_pipeline.json")
    args = parser.parse_args()
    setup_logging("input_pipeline_benchmark")
    torch.set_num_threads(1)  # as a peer runs (training.num_threads); DataLoader workers use one thread each too
    results = {"date": time.strftime("%Y-%m-%d"), "seconds": args.seconds, "models": {}}
    for name in args.models:
        config_path, overrides = MODELS[name]
        config = load_config(config_path, [*overrides, "training.backend=single"])
        task_module = __import__(f"{config.task_module}.task", fromlist=["build_task"])
        context = RunContext.resolve(config)
        device, precision = context.device, context.precision
        torch.manual_seed(0)
        task = task_module.build_task(config)
        row = {
            "device": str(device),
            "precision": precision,
            "local_batch_size": config.training.local_batch_size,
            "model_step_samples_per_second": model_step_rate(task, device, precision, args.seconds),
            "pipeline_samples_per_second": {
                str(workers): pipeline_rate(task, workers, args.seconds, device.type == "cuda")
                for workers in args.workers
            },
        }
        step_rate = row["model_step_samples_per_second"]
        # above 1: the pipeline alone outruns the step, so (with a core to spare for it) training does not wait
        row["pipeline_over_step"] = {
            workers: rate / step_rate for workers, rate in row["pipeline_samples_per_second"].items()
        }
        results["models"][name] = row
        logger.info(f"{name}: {json.dumps(row)}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    logger.info(f"wrote {args.output}")


if __name__ == "__main__":
    main()
