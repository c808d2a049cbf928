"""Mixed precision on CPU (torch's autocast and GradScaler run there too), and the DataLoader input pipeline:
the same code paths a GPU run takes, on the tiny configs."""

from __future__ import annotations

import dataclasses
from itertools import islice
from pathlib import Path

import pytest
import torch

from albert.task import build_task as build_albert
from common.backends import SingleProcessBackend
from common.config import load_config
from common.context import RunContext
from common.errors import ConfigError
from common.precision import Precision, resolve_precision
from common.seeding import stable_seed
from common.trainer import Trainer
from swav.data import FASHION_MNIST_DIR
from swav.task import build_task as build_swav
from tests.helpers import ROOT, TINY_ALBERT, max_difference, run_script

CPU = torch.device("cpu")
TINY_SWAV = str(ROOT / "configs/swav/tiny.yaml")


def test_fp16_without_a_gpu_is_a_one_line_config_error_and_auto_is_fp32():
    with pytest.raises(ConfigError, match="training.precision=fp16 needs a CUDA GPU"):
        resolve_precision("fp16", CPU)
    assert resolve_precision("auto", CPU) == "fp32"
    assert resolve_precision("fp16", CPU, fp16_on_cpu=True) == "fp16"
    assert resolve_precision("bf16", CPU) == "bf16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="training.device=auto is the GPU there")
def test_the_run_context_holds_what_the_config_resolves_to_on_this_machine():
    context = RunContext.resolve(load_config(TINY_ALBERT, ["training.seed=3"]))
    assert context.device == CPU and context.precision is Precision.fp32 and not context.precision.loss_scaling
    assert f"{context.precision}" == "fp32"  # as error lines and result files name it
    # the data order of a peer is what it was before the run context (peers of both versions meet in one swarm)
    assert context.stream_seed("peer") == stable_seed(3, "peer")
    fp16 = RunContext.resolve(load_config(TINY_ALBERT, ["training.precision=fp16", "debug.fp16_on_cpu=true"]))
    assert fp16.precision is Precision.fp16 and fp16.precision.loss_scaling


def test_train_script_rejects_fp16_on_a_cpu_in_one_line(tmp_path):
    result = run_script(
        "scripts/train.py",
        "--config",
        TINY_ALBERT,
        "training.backend=single",
        "training.device=cpu",
        "training.precision=fp16",
        "task.max_documents=300",
        f"training.output_dir={tmp_path}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: training.precision=fp16 needs a CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr


def train_single(
    tmp_path: Path, steps: int, overrides=(), precision: str = "fp32", inject_overflow_at_step: int = -1
) -> tuple:
    config = load_config(
        TINY_ALBERT,
        [
            "task.max_documents=600",
            "task.classifier_dropout_prob=0.0",
            "training.local_batch_size=8",
            "collaboration.target_batch_size=16",
            "task.warmup_steps=1",
            *overrides,
        ],
    )
    torch.manual_seed(0)
    task = build_albert(config)
    context = RunContext(CPU, Precision(precision), seed=0)
    backend = SingleProcessBackend(task, config.collaboration, context.precision)
    training = dataclasses.replace(config.training, max_global_steps=steps, max_wall_seconds=120, log_every_seconds=60)
    debug = dataclasses.replace(config.debug, inject_overflow_at_step=inject_overflow_at_step)
    trainer = Trainer(
        task, backend, training, context, peer_name="single", stream_seed=7, output_dir=tmp_path, debug=debug
    )
    summary = trainer.run()
    return summary, {name: value.clone() for name, value in task.model.state_dict().items()}


def test_single_fp16_overflow_skips_that_global_step_and_halves_the_loss_scale(tmp_path):
    one_step, after_one = train_single(tmp_path / "one", 1, precision="fp16")
    assert one_step.loss_scale == 2.0**16 and one_step.overflow_discards == 0
    skipped, after_two = train_single(tmp_path / "two", 2, precision="fp16", inject_overflow_at_step=1)
    assert skipped.global_steps == 2 and skipped.overflow_discards == 1
    assert skipped.loss_scale == 2.0**15
    assert max_difference(after_two, after_one) == 0.0  # step 1 changed nothing
    _, after_two_clean = train_single(tmp_path / "clean", 2, precision="fp16")
    assert max_difference(after_two_clean, after_one) > 0  # (a real step 1 does move the weights)


def test_fp16_loss_scaling_matches_fp32_training_closely(tmp_path):
    _, fp32 = train_single(tmp_path / "fp32", 2)
    _, fp16 = train_single(tmp_path / "fp16", 2, precision="fp16")
    # CPU autocast runs matmuls in float16 (about 3 decimal digits); LAMB moves weights by at most ~lr per step
    assert 0 < max_difference(fp16, fp32) < 2 * 2 * 0.004


def first_batches(task, stream_seed: int, workers: int, count: int) -> list:
    stream = task.batch_stream(stream_seed, workers=workers)
    try:
        return list(islice(stream, count))
    finally:
        getattr(stream, "close", lambda: None)()


def assert_same_batches(first: list, second: list) -> None:
    assert len(first) == len(second)
    for one, other in zip(first, second):
        assert one.keys() == other.keys()
        for name in one:
            assert torch.equal(one[name], other[name]), name


def test_albert_dataloader_workers_give_the_same_batches_as_the_training_thread():
    config = load_config(TINY_ALBERT, ["task.max_documents=600", "training.local_batch_size=8"])
    task = build_albert(config)
    in_thread = first_batches(task, 3, workers=0, count=7)
    assert_same_batches(in_thread, first_batches(task, 3, workers=2, count=7))
    assert not torch.equal(in_thread[0]["sample_ids"], first_batches(task, 4, workers=2, count=1)[0]["sample_ids"])


@pytest.mark.skipif(
    not Path(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz").exists(), reason="dataset-fashion-mnist missing"
)
def test_swav_multicrop_dataloader_workers_give_the_same_batches_as_the_training_thread():
    config = load_config(TINY_SWAV, ["task.max_images=256", "training.local_batch_size=8"])
    task = build_swav(config)
    assert_same_batches(first_batches(task, 5, workers=0, count=5), first_batches(task, 5, workers=2, count=5))
