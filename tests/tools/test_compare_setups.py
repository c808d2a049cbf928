"""The collaborative-vs-HPC comparison: the paper-scale baseline config, and the experiment script end to end."""

import csv
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from common.config import Backend, load_config
from common.errors import DataError
from common.tools.comparison import (
    RUN_RECORD,
    all_setups,
    evaluate,
    finished_run,
    launch_command,
    plot_title,
    recipe,
)
from tests.helpers import PYTHON, ROOT, run_script

PAPER_WORKERS = 8  # the paper's HPC baseline: 8 x V100 with all-reduce


def test_paper_baseline_config_is_the_paper_recipe_on_ddp_with_a_consistent_global_batch():
    baseline = load_config(ROOT / "configs/albert/baseline_paper.yaml")
    collaborative = load_config(ROOT / "configs/albert/paper.yaml")
    assert baseline.training.backend == Backend.ddp
    assert baseline.training.precision == "fp16"
    assert baseline.task == collaborative.task  # same model, data and LAMB schedule as the collaborative run
    assert baseline.collaboration.target_batch_size == collaborative.collaboration.target_batch_size == 4096
    micro_batches_per_step = baseline.training.local_batch_size * PAPER_WORKERS
    assert baseline.collaboration.target_batch_size % micro_batches_per_step == 0
    accumulation = baseline.collaboration.target_batch_size // micro_batches_per_step
    assert baseline.training.local_batch_size * accumulation * PAPER_WORKERS == 4096
    assert baseline.training.max_global_steps == collaborative.training.max_global_steps
    assert (
        OmegaConf.load(ROOT / "configs/albert/baseline_paper.yaml").task
        == OmegaConf.load(ROOT / "configs/albert/paper.yaml").task
    )  # the YAML copies stay identical too


def test_plot_title_names_worker_counts_only_for_setups_that_ran():
    setups = {setup.name: setup for setup in all_setups()}
    pair = plot_title([setups["single"], setups["collab_sync"]], 500, 256, workers=2, trainers=3)
    assert pair == "tiny ALBERT, 500 steps x 256 samples, 3 trainers"
    every = plot_title(list(setups.values()), 250, 256, workers=2, trainers=3)
    assert every == "tiny ALBERT, 250 steps x 256 samples, 2 DDP workers, 3 trainers"
    alone = plot_title([setups["single_dpu"]], 250, 256, workers=2, trainers=3)
    assert alone == "tiny ALBERT, 250 steps x 256 samples"


def reduced_comparison(output: Path, runs: Path, *options: str) -> list:
    """The script and its arguments for a reduced comparison (results to ``output``, run folders to ``runs``)."""
    return [
        "scripts/experiments/compare_setups.py",
        "--reduced",
        "--output",
        str(output),
        "--runs",
        str(runs),
        *options,
    ]


def test_compare_setups_rejects_a_global_batch_the_workers_cannot_split(tmp_path):
    result = run_script(*reduced_comparison(tmp_path, tmp_path / "runs", "--workers", "3"), timeout=120)
    assert result.returncode != 0
    assert "must be a multiple of" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()  # refused before any process started


def test_a_finished_run_is_reused_only_for_the_same_recipe(tmp_path):
    setups = {setup.name: setup for setup in all_setups()}
    overrides = ["training.max_global_steps=4"]
    for name in ("single", "single_dpu", "ddp", "collab_sync"):
        run_dir = tmp_path / name
        run_dir.mkdir()
        command = launch_command(setups[name], "configs/albert/tiny.yaml", overrides, run_dir, 2)
        record = {"recipe": recipe(command), "inputs": "pieces-v2", "launched": 10.0, "finished": 70.0}
        (run_dir / RUN_RECORD).write_text(json.dumps(record))
        # torchrun's port differs from launch to launch; that is not a different run
        run = finished_run(setups[name], "configs/albert/tiny.yaml", overrides, run_dir, 2, "pieces-v2")
        assert run is not None and (run.launched, run.finished, run.exit_code) == (10.0, 70.0, 0)
        changed = ["training.max_global_steps=5"]
        assert finished_run(setups[name], "configs/albert/tiny.yaml", changed, run_dir, 2, "pieces-v2") is None
        if setups[name].kind != "single":  # one more worker or trainer is another run
            assert finished_run(setups[name], "configs/albert/tiny.yaml", overrides, run_dir, 3, "pieces-v2") is None
        # the same command on a tokenizer that numbers its pieces otherwise is another run
        assert finished_run(setups[name], "configs/albert/tiny.yaml", overrides, run_dir, 2, "pieces-v3") is None
    never_ran = tmp_path / "never_ran"
    assert finished_run(setups["single"], "configs/albert/tiny.yaml", overrides, never_ran, 2, "pieces-v2") is None


def run_until_done(arguments: list, timeout: float) -> subprocess.CompletedProcess:
    """Run the script; on timeout SIGTERM it so it stops the setup it is running (whose peers have own sessions)."""
    process = subprocess.Popen(
        [PYTHON, *arguments],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
        pytest.fail(f"compare_setups.py did not finish within {timeout:.0f} s: {stderr[-1500:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


SETUPS = ["single", "single_dpu", "ddp", "collab_sync", "collab_dpu", "collab_local"]
REDUCED_STEPS, REDUCED_TARGET = 4, 64


def check_comparison_outputs(output) -> None:
    with (output / "summary.csv").open() as handle:
        summary = {row["setup"]: row for row in csv.DictReader(handle)}
    assert list(summary) == SETUPS
    for name, row in summary.items():
        assert int(row["steps"]) == REDUCED_STEPS, name
        assert 4.0 < float(row["eval_loss"]) < 20.0, name  # a real cross-entropy of an untrained ALBERT head
        assert float(row["samples_per_second_end_to_end"]) > 0, name
    # single and DDP do exactly the global batch per step; hivemind counts reported samples toward the target
    assert {int(summary[name]["samples"]) for name in ("single", "single_dpu", "ddp")} == {
        REDUCED_STEPS * REDUCED_TARGET
    }
    # the one-step-late updates of single_dpu leave another model; each swarm is also set against its own rule
    assert summary["single_dpu"]["eval_loss"] != summary["single"]["eval_loss"]
    for swarm, reference in (("collab_sync", "single"), ("collab_dpu", "single_dpu")):
        own, other = float(summary[swarm]["eval_loss"]), float(summary[reference]["eval_loss"])
        assert float(summary[swarm]["eval_loss_vs_one_process_percent"]) == pytest.approx(
            100 * (own - other) / other, abs=1e-3
        )
    assert summary["collab_local"]["eval_loss_vs_one_process_percent"] == ""
    assert float(summary["ddp"]["eval_loss_vs_ddp_percent"]) == 0.0

    with (output / "curves.csv").open() as handle:
        curves = list(csv.DictReader(handle))
    for name in SETUPS:
        own = [row for row in curves if row["setup"] == name]
        assert [int(row["step"]) for row in own] == list(range(REDUCED_STEPS)), name
        seen = [int(row["samples_seen"]) for row in own]
        assert seen == sorted(seen) and seen[0] > 0, name
    assert (output / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = (output / "results.md").read_text()
    assert "scripts/experiments/compare_setups.py --reduced" in results and "Load average" in results
    assert "held-out documents (never trained on)" in results  # scored on documents no setup trained on
    assert all(f"| {name} |" in results for name in SETUPS)


@pytest.mark.slow
@pytest.mark.timeout(1260)
def test_reduced_comparison_runs_every_setup_and_writes_csv_png_and_results(tmp_path):
    output = tmp_path / "results"
    result = run_until_done(reduced_comparison(output, tmp_path / "runs"), timeout=1140)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[1/6] single: launching" in result.stderr and "[6/6] collab_local: done in" in result.stderr
    check_comparison_outputs(output)
    first_summary = (output / "summary.csv").read_text()

    # The same command with --reuse-finished scores the finished runs again instead of relaunching any of them
    rescored = tmp_path / "rescored"
    result = run_until_done([*reduced_comparison(rescored, tmp_path / "runs"), "--reuse-finished"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count(": reusing the finished run in") == 6, result.stderr[-3000:]
    assert ": launching" not in result.stderr
    assert (rescored / "summary.csv").read_text() == first_summary
    assert "Reused finished runs of this command" in (rescored / "results.md").read_text()


def test_diloco_setups_carry_their_inner_steps_and_a_run_id_of_their_own(tmp_path):
    setups = {setup.name: setup for setup in all_setups([4, 20])}
    assert "collab_diloco_h4" in setups and "collab_diloco_h4" not in {setup.name for setup in all_setups()}
    command = launch_command(setups["collab_diloco_h20"], "configs/albert/tiny.yaml", [], tmp_path, 4)
    assert "collaboration.semantics=diloco" in command and "collaboration.inner_steps=20" in command
    assert command[-1] == "collaboration.run_id=compare_diloco_h20"
    sync = launch_command(setups["collab_sync"], "configs/albert/tiny.yaml", [], tmp_path, 4)
    assert sync[-1] == "collaboration.run_id=compare_sync"  # earlier runs of the other setups stay reusable


def test_a_missing_or_unreadable_final_model_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "trainer0" / "final_state.pt"
    with pytest.raises(DataError, match="no final model at .*trainer0"):
        evaluate(None, [], missing)
    missing.parent.mkdir()
    missing.write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match="cannot read the final model"):
        evaluate(None, [], missing)
