"""The GPU throughput script runs end to end on a CPU with the tiny configs (the three loops, real peers)."""

import json

import pytest

from tests.helpers import assert_no_processes_left, run_script


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_throughput_script_runs_tiny_on_cpu(tmp_path):
    output = tmp_path / "throughput.json"
    options = ["--tiny", "--seconds", "8", "--output", str(output), "--runs", str(tmp_path / "runs")]
    result = run_script("scripts/experiments/gpu_throughput.py", *options, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())
    assert results["device"] == "cpu"
    assert set(results["models"]) == {"albert_tiny", "swav_tiny"}
    for row in results["models"].values():
        for loop in ("plain", "single", "peer"):
            assert row[loop]["samples_per_second"] > 0 and row[loop]["peak_memory_mb"] > 0
    assert_no_processes_left(tmp_path)
