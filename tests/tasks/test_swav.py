"""SwAV task: paper-scale build + step, loss vs a direct computation, Sinkhorn marginals, prototype freezing,
the global-step queue switch, the schedule, single-process training, linear evaluation and a 2-trainer swarm."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightly.loss.swav_loss import sinkhorn
from PIL import Image

from common.backends import SingleProcessBackend
from common.config import CollaborationConfig, TrainingConfig, load_config
from common.context import RunContext
from common.errors import ConfigError, DataError
from common.precision import Precision
from common.task import ExportFacts
from common.trainer import Trainer
from swav.data import FASHION_MNIST_DIR, crop_key, load_fashion_mnist, open_images
from swav.linear_eval import evaluate, knn_top1, load_model
from swav.task import build_task, learning_rate, load_exported_trunk
from tests.helpers import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/swav/tiny.yaml")
CPU_FP32 = RunContext(torch.device("cpu"), Precision.fp32, seed=0)
PAPER = str(ROOT / "configs/swav/paper.yaml")

pytestmark = pytest.mark.skipif(
    not Path(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz").exists(),
    reason="Debian package dataset-fashion-mnist is not installed",
)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_task(*overrides: str):
    config = load_config(TINY, ["task.max_images=512", "training.local_batch_size=8", *overrides])
    torch.manual_seed(0)
    return build_task(config)


def direct_swav_loss(
    scores: list, num_large: int, temperature: float, epsilon: float, iterations: int
) -> torch.Tensor:
    """SwAV's loss written out from the paper: Sinkhorn-Knopp codes of each large crop, predicted by the others."""
    total = 0.0
    for assigned in range(num_large):
        codes = torch.exp(scores[assigned].detach() / epsilon).t()  # prototypes x samples
        codes /= codes.sum()
        num_prototypes, batch = codes.shape
        for _ in range(iterations):
            codes /= codes.sum(dim=1, keepdim=True) * num_prototypes
            codes /= codes.sum(dim=0, keepdim=True) * batch
        codes = (codes * batch).t()
        others = [view for view in range(len(scores)) if view != assigned]
        cross_entropy = sum(
            -(codes * F.log_softmax(scores[view] / temperature, dim=1)).sum(dim=1).mean() for view in others
        )
        total = total + cross_entropy / len(others)
    return total / num_large


def test_idx_parsing_gives_real_fashion_mnist():
    images, labels = load_fashion_mnist("t10k")
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10000,) and set(np.unique(labels)) == set(range(10))
    assert 50 < images.mean() < 100  # real product photos on a black background, not noise or zeros


def test_missing_fashion_mnist_names_the_debian_package(tmp_path):
    with pytest.raises(DataError, match="dataset-fashion-mnist"):
        load_fashion_mnist("train", str(tmp_path))


def test_missing_image_folder_is_a_data_error(tmp_path):
    config = load_config(TINY, [f"task.dataset={tmp_path / 'no_such_imagenet'}"])
    with pytest.raises(DataError, match="does not exist"):
        build_task(config)


@pytest.mark.parametrize(
    "override, key",
    [
        ("task.crop_counts=[1,2]", "task.crop_counts"),
        ("task.crop_min_scales=[0.5,0.2]", "task.crop_min_scales"),
        ("task.arch=vgg", "task.arch"),
        ("task.sinkhorn_epsilon=0", "task.sinkhorn_epsilon"),
    ],
)
def test_bad_config_is_one_line_error_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TINY, [override])


def test_corrupt_image_in_a_folder_is_skipped_with_one_warning(tmp_path, caplog):
    images, _ = load_fashion_mnist("t10k")
    folder = tmp_path / "images" / "class0"
    folder.mkdir(parents=True)
    Image.fromarray(images[0]).save(folder / "a.png")
    (folder / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    Image.fromarray(images[1]).save(folder / "c.png")
    source = open_images(str(tmp_path / "images"), FASHION_MNIST_DIR, None)
    with caplog.at_level(logging.WARNING, logger="swav.data"):
        substitute = [np.asarray(source.image(1)) for _ in range(2)]
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "b.png" in warnings[0], warnings
    expected = np.asarray(Image.fromarray(images[1]).convert("RGB"))
    assert all(np.array_equal(image, expected) for image in substitute)  # the next readable image stands in
    (folder / "a.png").write_bytes(b"broken")
    (folder / "c.png").write_bytes(b"broken")
    with pytest.raises(DataError, match="no image in .* decodes"):
        open_images(str(tmp_path / "images"), FASHION_MNIST_DIR, None).image(0)


def test_views_are_deterministic_per_sample_and_pass():
    task = tiny_task()
    first, again = task.dataset.batch([3, 7], 0), task.dataset.batch([3, 7], 0)
    other_pass = task.dataset.batch([3, 7], 1)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first[crop_key(0)], other_pass[crop_key(0)])
    assert first[crop_key(0)].shape == (2, 3, 28, 28) and first[crop_key(2)].shape == (2, 3, 16, 16)
    assert first["sample_ids"].tolist() == [3, 7]


@pytest.mark.timeout(180)
def test_paper_config_builds_resnet50_and_takes_one_step():
    config = load_config(
        PAPER,
        ["task.dataset=fashion_mnist", "task.max_images=64", "task.crop_counts=[2,2]", "training.local_batch_size=2"],
    )
    torch.manual_seed(0)
    task = build_task(config)
    model = task.model
    assert type(model.trunk).__name__ == "ResNet" and model.feature_dim == 2048
    head = [layer for layer in model.projection_head.layers if isinstance(layer, torch.nn.Linear)]
    assert [(layer.in_features, layer.out_features) for layer in head] == [(2048, 2048), (2048, 128)]
    assert any(isinstance(layer, torch.nn.BatchNorm1d) for layer in model.projection_head.layers)
    assert model.prototypes.weight.shape == (3000, 128)
    assert task.config.queue_length == 3840
    assert sum(param.numel() for param in model.trunk.parameters()) == 23_508_032  # torchvision ResNet-50 trunk

    backend = SingleProcessBackend(task, CollaborationConfig(target_batch_size=2))
    batch = next(task.batches(stream_seed=0))
    assert batch[crop_key(0)].shape == (2, 3, 224, 224) and batch[crop_key(2)].shape == (2, 3, 96, 96)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    output = task.forward(model, batch)
    assert math.isfinite(output.loss.item())
    output.loss.backward()
    task.after_backward(model, backend.global_step)
    assert backend.step(output.batch_size) == 0
    task.on_global_step(model, 1)
    assert backend.optimizer.param_groups[0]["lr"] == pytest.approx(learning_rate(1, task.config))
    changed = [name for name, param in model.named_parameters() if not torch.equal(param, before[name])]
    assert any(name.startswith("trunk.") for name in changed) and any(
        name.startswith("projection_head.") for name in changed
    )
    # prototypes are frozen for the first epoch of global steps: only weight decay's radial shrink, undone by
    # normalising
    assert torch.allclose(model.prototypes.weight, before["prototypes.layer.weight"], atol=1e-6)


IMAGENET_TRAIN_IMAGES = 1_281_167


def test_paper_freezes_prototypes_for_one_epoch_of_global_steps():
    """SwAV freezes the prototypes for one epoch (5005 iterations at batch 256, 313 at 4096). In global steps of the
    swarm's target batch that is ceil(ImageNet / target), whatever the number of peers."""
    config = load_config(PAPER)
    epoch = math.ceil(IMAGENET_TRAIN_IMAGES / config.collaboration.target_batch_size)
    assert config.task.freeze_prototypes_steps == epoch == 40
    assert config.task.freeze_prototypes_steps < config.task.warmup_steps < config.task.total_steps
    # the authors' command: warmup 500 of 5,000 global steps, 64 samples per micro-batch
    assert (config.task.warmup_steps, config.task.total_steps) == (500, 5000)
    assert config.training.max_global_steps == config.task.total_steps
    assert config.training.local_batch_size == 64
    assert config.training.dataloader_workers > 0  # multi-crop must not run on the training thread of a GPU peer


def test_task_loss_matches_direct_computation():
    task = tiny_task("task.queue_length=0")
    model = task.model
    batch = task.dataset.batch(list(range(8)), 0)
    output = task.forward(model, batch)
    with torch.no_grad():
        _, scores = model([batch[crop_key(index)] for index in range(task.num_crops)])
    direct = direct_swav_loss(list(scores.split(8)), num_large=2, temperature=0.1, epsilon=0.03, iterations=3)
    assert output.loss.item() == pytest.approx(direct.item(), rel=1e-5)


def test_sinkhorn_rows_and_columns():
    generator = torch.Generator().manual_seed(0)
    scores = (
        F.normalize(torch.randn(64, 128, generator=generator), dim=1)
        @ F.normalize(torch.randn(16, 128, generator=generator), dim=1).t()
    )  # cosine scores: 64 samples, 16 prototypes
    codes = sinkhorn(scores, iterations=3, epsilon=0.03)
    assert torch.allclose(codes.sum(dim=1), torch.ones(64), atol=1e-5)  # each sample's code is a distribution
    converged = sinkhorn(scores, iterations=200, epsilon=0.3)
    assert torch.allclose(converged.sum(dim=0), torch.full((16,), 64 / 16), rtol=1e-3)  # equipartition
    assert torch.all(codes >= 0)


def test_queue_switches_on_at_configured_global_step():
    task = tiny_task("task.queue_start_step=3", "task.queue_length=16")
    model = task.model
    batch = task.dataset.batch(list(range(8)), 0)
    for step in (1, 2):
        task.on_global_step(model, step)
        assert task.queue is None
        assert task.forward(model, batch).metrics["queue_used"] == 0.0
    task.on_global_step(model, 3)
    assert task.queue is not None and not task.queue.full
    for start in (8, 16):  # 2 other micro-batches of 8 fill the 16-long queue; it is used only once full
        assert task.forward(model, task.dataset.batch(list(range(start, start + 8)), 0)).metrics["queue_used"] == 0.0
    assert task.queue.full
    without_queue = tiny_task("task.queue_length=0")
    without_queue.model.load_state_dict(model.state_dict())
    with_queue_output = task.forward(model, batch)
    assert with_queue_output.metrics["queue_used"] == 1.0
    assert with_queue_output.loss.item() != pytest.approx(
        without_queue.forward(without_queue.model, batch).loss.item()
    )


def test_prototypes_frozen_then_trained_and_normalised():
    task = tiny_task("task.freeze_prototypes_steps=2")
    model = task.model
    batch = task.dataset.batch(list(range(8)), 0)
    task.forward(model, batch).loss.backward()
    task.after_backward(model, 1)
    assert torch.count_nonzero(model.prototypes.layer.weight.grad) == 0
    model.zero_grad()
    task.forward(model, batch).loss.backward()
    task.after_backward(model, 2)
    assert torch.count_nonzero(model.prototypes.layer.weight.grad) > 0
    with torch.no_grad():
        model.prototypes.layer.weight.mul_(3.0)
    task.on_global_step(model, 3)
    assert torch.allclose(
        model.prototypes.layer.weight.norm(dim=1), torch.ones(model.prototypes.layer.weight.shape[0])
    )


def test_learning_rate_schedule():
    config = load_config(PAPER).task
    assert learning_rate(0, config) == pytest.approx(0.3)
    assert learning_rate(config.warmup_steps // 2, config) == pytest.approx((0.3 + 2.4) / 2, rel=1e-2)
    assert learning_rate(config.warmup_steps, config) == pytest.approx(2.4)
    assert learning_rate(config.total_steps, config) == pytest.approx(0.0048)
    assert learning_rate(config.total_steps + 100, config) == pytest.approx(0.0048)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_single_backend_training_lowers_the_loss(tmp_path):
    config = load_config(
        TINY,
        [
            "task.max_images=2048",
            "training.local_batch_size=32",
            "task.warmup_steps=2",
            "task.total_steps=14",
            "task.freeze_prototypes_steps=2",
            "task.queue_length=0",
            f"training.output_dir={tmp_path}",
        ],
    )
    torch.manual_seed(0)
    task = build_task(config)
    backend = SingleProcessBackend(task, CollaborationConfig(target_batch_size=64))
    training = dataclasses.replace(config.training, max_global_steps=14, max_wall_seconds=150, log_every_seconds=60)
    trainer = Trainer(task, backend, training, CPU_FP32, peer_name="single", stream_seed=0, output_dir=tmp_path)
    summary = trainer.run()
    assert summary.global_steps == 14
    losses = [record["loss"] for record in read_jsonl(tmp_path / "steps.jsonl")]
    assert len(losses) == 14
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1, losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threshold, warns", [(0.01, True), (1.0, False)])
def test_trainer_warns_when_the_loop_waits_on_multi_crop(tmp_path, caplog, threshold, warns):
    """Multi-crop built on the training thread (no loader workers) is time the model waits: above the share it
    tolerates, the progress line comes with one WARNING naming training.dataloader_workers."""
    task = tiny_task("task.queue_length=0")
    # a progress line (and its data-wait check) after every micro-batch
    training = TrainingConfig(max_global_steps=3, max_wall_seconds=60, log_every_seconds=1e-9)
    trainer = Trainer(
        task,
        SingleProcessBackend(task, CollaborationConfig(target_batch_size=16)),
        training,
        CPU_FP32,
        peer_name="single",
        stream_seed=0,
        output_dir=tmp_path,
        data_wait_warning_share=threshold,
    )
    with caplog.at_level(logging.WARNING, logger="common.trainer"):
        trainer.run()
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert bool(warnings) == warns, warnings
    assert all("training.dataloader_workers (now 0)" in message for message in warnings)


def test_export_holds_the_trunk_with_its_batchnorm_statistics(tmp_path):
    task = tiny_task()
    with torch.no_grad():  # statistics a training run would have left
        for module in task.model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
    facts = ExportFacts(run_id="swav_tiny", global_step=3, samples=192, exported_by="a test", backend="single")
    folder = task.export_pretrained(task.model, tmp_path / "hf_model", facts)
    trunk = load_exported_trunk(folder, task.config)
    expected = task.model.trunk.state_dict()
    assert trunk.state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[name]) for name, value in trunk.state_dict().items())
    assert "global step 3" in (folder / "README.md").read_text()
    assert not (tmp_path / "hf_model.partial").exists()


def test_knn_votes_for_nearest_labels():
    train = torch.eye(10).repeat(5, 1) + 0.01
    labels = np.tile(np.arange(10), 5)
    assert knn_top1(train, labels, torch.eye(10), np.arange(10), k=5) == 1.0
    assert knn_top1(train, labels, torch.eye(10), np.roll(np.arange(10), 1), k=5) == 0.0


@pytest.mark.timeout(120)
def test_linear_eval_of_random_init_is_above_chance():
    config = load_config(TINY)
    result = evaluate(
        load_model(config, None), image_size=28, fashion_mnist_dir=FASHION_MNIST_DIR, max_train=1000, max_test=500
    )
    assert result.feature_dim == 128 and result.train_images == 1000 and result.test_images == 500
    assert 0.3 < result.linear_top1 <= 1.0 and 0.3 < result.knn_top1 <= 1.0  # chance is 0.1


def test_linear_eval_rejects_a_state_of_another_model(tmp_path):
    torch.save({"unrelated.weight": torch.zeros(1)}, tmp_path / "final_model.pt")
    with pytest.raises(DataError, match="does not fit"):
        load_model(load_config(TINY), str(tmp_path / "final_model.pt"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_trainer_swarm_stays_in_sync(tmp_path):
    """Two trainers and a monitor: parameters and BatchNorm running statistics agree between the trainers (the
    statistics are averaged with the state), and the monitor's checkpoint holds trained statistics."""
    from common.checkpoints import load_latest_checkpoint
    from common.optimizer import averaged_buffers
    from common.swarm import LocalSwarm

    overrides = [
        "task.max_images=4096",
        "training.local_batch_size=16",
        # 6 micro-batches per trainer and step: a step must outlast hivemind's progress refresh (about a second),
        # or a trainer may reach the target before it sees the other and take global step 0 alone (it warns); the
        # two then pair each other's rounds a step apart until the end (at 64 a loaded machine did that once)
        "collaboration.target_batch_size=192",
        "collaboration.expected_peers=2",
        "training.max_global_steps=6",
        "task.total_steps=6",
        "task.warmup_steps=1",
        "task.freeze_prototypes_steps=2",
        "task.queue_start_step=3",
        "task.queue_length=32",
        "collaboration.matchmaking_time=1.0",
        # with hivemind's default chunk timeout (matchmaking_time: 1 s) a trainer once dropped its groupmate's
        # parts that had not come within the second; the two trainers' rounds then paired different steps, and
        # the last step ran alone with local gradients
        "collaboration.averaging_timeout=60",
        "collaboration.next_chunk_timeout=30",
        "training.log_every_seconds=5",
        "monitor.checkpoint_every_steps=2",
        "monitor.wandb_mode=disabled",
    ]
    with LocalSwarm(TINY, tmp_path, overrides) as swarm:
        swarm.start_first_peer("monitor", "monitor", timeout=120)
        swarm.start("trainer", "trainer0")
        swarm.start("trainer", "trainer1")
        finished = swarm.wait(["trainer0", "trainer1"], timeout=240)
        logs = {name: peer.log_tail(8) for name, peer in swarm.peers.items()}
        assert finished, logs
        assert all(swarm.peers[name].process.returncode == 0 for name in ("trainer0", "trainer1")), logs
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("trainer0", "trainer1")]
    assert [summary["global_steps"] for summary in summaries] == [6, 6]
    assert all(summary["samples"] > 0 for summary in summaries)  # both contributed
    states = [torch.load(tmp_path / name / "final_model.pt") for name in ("trainer0", "trainer1")]
    config = load_config(TINY)
    torch.manual_seed(config.training.seed)
    model = build_task(config, with_data=False).model
    initial = model.state_dict()
    parameter_names = [name for name, _ in model.named_parameters()]
    # fp16 wire compression of gradients and state averaging: peers agree to ~1e-3, far below how far they moved
    for name in parameter_names:
        torch.testing.assert_close(states[0][name], states[1][name], atol=2e-3, rtol=0, msg=name)
    moved = max(float((states[0][name] - initial[name]).abs().max()) for name in parameter_names)
    assert moved > 2e-2
    buffer_ids = {id(buffer) for buffer in averaged_buffers(model)}
    buffer_names = [name for name, buffer in model.named_buffers() if id(buffer) in buffer_ids]
    assert any(name.endswith("running_var") for name in buffer_names) and len(buffer_names) > 10
    # each trainer's batches give its own statistics; averaged with the state they agree to fp16's precision
    for name in buffer_names:
        torch.testing.assert_close(states[0][name], states[1][name], atol=5e-3, rtol=5e-3, msg=name)
    checkpoint = load_latest_checkpoint(tmp_path / "monitor" / "checkpoints")
    assert checkpoint is not None and checkpoint["step"] >= 2
    trained = max(float((checkpoint["model"][name] - initial[name]).abs().max()) for name in buffer_names)
    assert trained > 1e-2, "the monitor checkpointed the initial BatchNorm statistics"
