"""The GPU checks script (scripts/experiments/gpu_throughput.py): its bounded batch search, its refusal without a
GPU, the cost model's loader for what it writes, and a short end-to-end run of the tiny configs on a CPU."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from common.errors import DataError
from common.tools.cost_model import NodeGroup, SetupConfig, TaskSpec, load_measured_throughput, predict
from tests.helpers import assert_no_processes_left, run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/experiments/gpu_throughput.py"
sys.path.insert(0, str(ROOT / "scripts" / "experiments"))
import gpu_throughput  # noqa: E402  (a script, importable from its folder)


def test_batch_search_doubles_then_bisects_within_its_bounds():
    largest, tried = gpu_throughput.largest_fitting(lambda size: size <= 40, start=4, cap=256, bisections=3)
    assert largest == 40
    assert tried == [4, 8, 16, 32, 64, 48, 40, 44]  # doubling until 64 fails, then three bisections


def test_batch_search_stops_at_its_cap_and_when_nothing_fits():
    assert gpu_throughput.largest_fitting(lambda size: True, start=16, cap=100, bisections=3) == (
        100,
        [16, 32, 64, 100],
    )
    assert gpu_throughput.largest_fitting(lambda size: False, start=16, cap=100, bisections=3) == (0, [16])


def test_the_budget_counts_from_the_start_and_records_what_it_skips():
    budget = gpu_throughput.Budget(100.0, started=time.time() - 90.0)  # a process started 90 s ago
    assert 9.0 < budget.left() <= 10.0
    assert budget.allows("a short phase", 5.0) and not budget.allows("a long phase", 30.0)
    assert len(budget.skipped) == 1 and budget.skipped[0].startswith("a long phase: it needs up to 30 s")


def test_a_batch_repeated_keeps_every_tensor_batch_first():
    batch = {
        "input_ids": torch.arange(6).reshape(2, 3),
        "sample_ids": torch.tensor([5, 7]),
        "pass_index": torch.tensor(1),
    }
    bigger = gpu_throughput.repeated(batch, 3)
    assert bigger["input_ids"].shape == (6, 3) and bigger["sample_ids"].tolist() == [5, 7] * 3
    assert bigger["pass_index"].dim() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_gpu_mode_without_a_gpu_is_one_error_line(tmp_path):
    result = run_script(SCRIPT, "--output-dir", str(tmp_path / "out"), timeout=170)
    assert result.returncode == 2, result.stderr[-1500:]
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: no CUDA device"), result.stderr[-1500:]
    assert not (tmp_path / "out").exists()


def test_the_paper_scale_configs_load_with_every_override():
    """What the GPU run would load (the paper's models on offline data, both precisions) is valid config."""
    arguments = gpu_throughput.parse_arguments(["--output-dir", "unused"])
    for name in gpu_throughput.MODELS:
        for precision in gpu_throughput.PRECISIONS:
            config = gpu_throughput.load_config(*gpu_throughput.model_overrides(arguments, name, precision))
            assert config.training.precision == precision
    albert = gpu_throughput.load_config(*gpu_throughput.model_overrides(arguments, "albert_large", "bf16"))
    assert (albert.task.hidden_size, albert.task.num_hidden_layers, albert.task.max_seq_length) == (1024, 24, 512)
    swav = gpu_throughput.load_config(*gpu_throughput.model_overrides(arguments, "swav_resnet50", "bf16"))
    assert (swav.task.arch, list(swav.task.crop_sizes), list(swav.task.crop_counts)) == ("resnet50", [224, 96], [2, 6])
    carried = gpu_throughput.parse_arguments(["--output-dir", "unused", "--fashion-mnist-dir", "/carried/fashion"])
    swav = gpu_throughput.load_config(*gpu_throughput.model_overrides(carried, "swav_resnet50", "fp16"))
    assert swav.task.fashion_mnist_dir == "/carried/fashion"


def _results_file(tmp_path: Path, **changes) -> Path:
    results = {
        "date": "2027-01-01 00:00:00 UTC",
        "tiny": False,
        "cost_model": {
            "device": "a synthetic GPU",
            "precision": "bf16",
            "loop": "single",
            "samples_per_second": {"albert_large": 50.0, "swav_resnet50": 600.0},
        },
    }
    results.update(changes)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return path


def test_a_measured_throughput_enters_the_cost_model_as_a_node_group(tmp_path):
    measured = load_measured_throughput(_results_file(tmp_path))
    assert measured.samples_per_second == {"albert_large": 50.0, "swav_resnet50": 600.0}
    assert measured.source.startswith("measured: a synthetic GPU, bf16, single loop, 2027-01-01")
    group = NodeGroup(
        name="measured", count=2, samples_per_second=measured.samples_per_second, throughput_source=measured.source
    )
    task = TaskSpec(name="albert_large", parameters=1000, target_batch_size=400, global_steps=10)
    prediction = predict(SetupConfig(name="measured", round_overhead_seconds=0.0, nodes=[group]), task)
    assert prediction.swarm_samples_per_second == 100.0
    assert prediction.accumulation_seconds == 4.0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tiny": True}, "smoke run"),
        ({"cost_model": {"device": "x", "precision": "bf16", "loop": "single", "samples_per_second": {}}}, "> 0"),
        (
            {"cost_model": {"device": "x", "precision": "bf16", "loop": "single", "samples_per_second": {"a": -1}}},
            "> 0",
        ),
        ({"cost_model": None}, "not a GPU checks. results.json"),
    ],
)
def test_a_bad_measured_throughput_file_is_a_data_error(tmp_path, changes, message):
    with pytest.raises(DataError, match=message):
        load_measured_throughput(_results_file(tmp_path, **changes))
    with pytest.raises(DataError, match="not found"):
        load_measured_throughput(tmp_path / "missing.json")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_gpu_checks_run_end_to_end_on_the_tiny_configs(tmp_path):
    """The same path as on a GPU, shortened: one model's loops in fp16 with loss scaling (plain, ours, a peer with an
    auxiliary peer) and the 2-trainer swarm with its monitor's checkpoint and export (the batch search's logic is
    tested above; the pipeline phase is the input-pipeline benchmark's, tested beside it)."""
    output = tmp_path / "out"
    options = ["--tiny", "--output-dir", str(output), "--runs-dir", str(tmp_path / "runs"), "--seconds", "3"]
    options += ["--models", "albert_large", "--precisions", "fp16", "--phases", "loops", "swarm"]
    result = run_script(SCRIPT, *options, "--swarm-steps", "3", "--budget-seconds", "360", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((output / "results.json").read_text())
    assert results["device"]["device"] == "cpu" and results["tiny"] and results["skipped"] == []
    loops = results["loops"]["albert_large"]["fp16"]
    for loop in ("plain", "single", "peer"):
        assert "error" not in loops[loop], loops[loop]
        assert loops[loop]["samples_per_second"] > 0 and loops[loop]["peak_memory_mb"] > 0
    assert 0 < loops["peer"]["compute_share"] <= 1 and loops["peer"]["global_steps"] >= 1
    swarm = results["swarm"]
    assert swarm["finished"] and swarm["global_steps"] == 3 and set(swarm["exit_codes"].values()) == {0}
    assert swarm["params_agree"] and swarm["checkpoints"] and "config.json" in swarm["exported"]
    single = loops["single"]
    rate = single["steady_samples_per_second"] or single["samples_per_second"]  # fewer than 2 steps on a busy CPU
    assert results["cost_model"]["samples_per_second"]["albert_large"] == rate
    written = {path.name for path in output.iterdir()}
    assert written == {
        "device.json",
        "results.json",
        "throughput.csv",
        "batch_search.csv",
        "pipeline.csv",
        "gpu_checks.png",
    }
    assert_no_processes_left(tmp_path)
