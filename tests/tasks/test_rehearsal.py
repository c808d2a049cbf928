"""The dress rehearsal of the paper configs (scripts/experiments/rehearsal.py): its pieces, its bad input, and -- on
request -- the cheapest config's whole rehearsal (SwAV: 202 s for the script alone with the machine's memory to itself
at load average 18, 2026-12-07, paper_results/fullscale: over the ~3 minutes a CI test may cost here)."""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from swav.data import FASHION_MNIST_DIR, open_images
from tests.helpers import ROOT, run_script

SCRIPT = ROOT / "scripts" / "experiments" / "rehearsal.py"
needs_fashion_mnist = pytest.mark.skipif(
    not Path(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz").exists(),
    reason="Debian package dataset-fashion-mnist is not installed",
)


def load_rehearsal_module():
    spec = importlib.util.spec_from_file_location("rehearsal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@needs_fashion_mnist
def test_png_folder_is_a_real_image_folder(tmp_path):
    rehearsal = load_rehearsal_module()
    folder = rehearsal.write_fashion_mnist_pngs(tmp_path / "png", 40)
    images = open_images(str(folder), FASHION_MNIST_DIR, None)
    assert len(images) == 40 and images.image(0).size == (28, 28)
    assert len({path.parent.name for path in folder.glob("*/*.png")}) > 1  # class folders, ImageNet's layout


def test_state_download_counts_parameters_buffers_and_optimizer_statistics():
    rehearsal = load_rehearsal_module()
    checkpoint = {
        "model": {"weight": torch.zeros(1024, 256), "running_var": torch.ones(256), "batches": torch.tensor(3)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(1024, 256), "step": torch.tensor(1.0)}}},
    }
    expected_mb = (2 * 1024 * 256 + 256) * 2 / 2**20  # fp16: the integer counter and the step scalar are not sent
    assert rehearsal.state_download_mb(checkpoint) == pytest.approx(expected_mb)


def test_every_rehearsal_overrides_load_and_fit_this_machines_cores(tmp_path):
    """Each config with its rehearsal's overrides is a valid config (a misspelt key would end the run late), the
    DDP workers' threads fit 2 cores (4 per worker made no step in 8 minutes: paper_results/fullscale), and some
    trainer can serve the swarm's state."""
    from common.config import load_config

    rehearsal = load_rehearsal_module()
    for name, entry in rehearsal.rehearsals(tmp_path).items():
        overrides = [override.format(steps=2) for override in entry.overrides]
        config = load_config(str(ROOT / entry.config), overrides)
        assert config.training.max_global_steps == 2, name
        if entry.ddp:
            assert config.training.num_threads == 1, name
        trainers = [
            load_config(str(ROOT / entry.config), [*overrides, *entry.peer_overrides.get(peer, [])])
            for peer in ("trainer0", "trainer1")
        ]
        # hivemind serves state only from peers that accept connections and step: with every trainer in client
        # mode, no peer served a state past step 0 to the monitor or a joiner (sahajBERT, run of 11:15)
        assert any(not trainer.network.client_mode for trainer in trainers), name


@pytest.mark.timeout(240)
def test_unknown_rehearsal_is_one_line_error(tmp_path):
    result = run_script(str(SCRIPT), "--configs", "gpt5", "--output", str(tmp_path), timeout=200)
    assert result.returncode == 2, result.stderr[-1000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unknown rehearsal 'gpt5'" in errors[0]


@needs_fashion_mnist
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(os.environ.get("DEDLOC_REHEARSAL") != "1", reason="about 4 minutes: set DEDLOC_REHEARSAL=1")
def test_swav_rehearsal_checkpoints_exports_and_serves_a_late_joiner(tmp_path):
    result = run_script(
        str(SCRIPT),
        "--configs",
        "swav_resnet50",
        "--output",
        str(tmp_path / "results"),
        "--runs",
        str(tmp_path / "runs"),
        "--timeout",
        "1200",
        timeout=1450,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    with (tmp_path / "results" / "rehearsal.csv").open() as stream:
        (row,) = list(csv.DictReader(stream))
    assert row["status"] == "ok", row
    assert int(row["steps"]) >= 2 and row["export_reloaded"] == "yes"
    assert row["batchnorm_trained"].startswith("yes")
    # the joiner downloaded the state from the running trainers and ended a step later, on their weights
    assert "from the running swarm" in row["late_joiner"], row["late_joiner"]
    assert int(row["late_joiner_step"]) >= 2 and float(row["late_joiner_max_abs_diff"].split()[0]) < 1e-2
