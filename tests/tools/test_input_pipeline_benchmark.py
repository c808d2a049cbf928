"""The input-pipeline micro-benchmark runs end to end (tiny ALBERT, briefly) and reports both rates."""

import json

import pytest

from tests.helpers import run_script


@pytest.mark.slow
def test_input_pipeline_benchmark_reports_pipeline_and_step_rates(tmp_path):
    output = tmp_path / "pipeline.json"
    result = run_script(
        "scripts/experiments/input_pipeline_benchmark.py",
        "--seconds",
        "0.5",
        "--models",
        "albert_tiny",
        "--workers",
        "0",
        "1",
        "--output",
        str(output),
        timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(output.read_text())["models"]["albert_tiny"]
    assert row["model_step_samples_per_second"] > 0
    assert set(row["pipeline_samples_per_second"]) == {"0", "1"}
    assert all(rate > 0 for rate in row["pipeline_samples_per_second"].values())
    assert set(row["pipeline_over_step"]) == {"0", "1"}  # the ratio the README quotes, for every worker count
