"""Config loading and validation: typed values, clear one-line errors."""

import pytest

from common.config import Backend, Compression, Semantics, load_config
from common.errors import ConfigError
from tests.helpers import ROOT, run_script

TINY = ROOT / "configs/albert/tiny.yaml"
PAPER = ROOT / "configs/albert/paper.yaml"


def test_tiny_config_loads_typed_values():
    config = load_config(TINY)
    assert config.task_module == "albert"
    assert config.collaboration.semantics is Semantics.sync
    assert config.collaboration.compression is Compression.fp16
    assert config.training.backend is Backend.collaborative
    assert type(config.task).__name__ == "TaskConfig"


def test_paper_config_has_the_papers_recipe():
    config = load_config(PAPER)
    task = config.task
    assert (task.hidden_size, task.num_hidden_layers, task.num_attention_heads) == (1024, 24, 16)
    assert (task.intermediate_size, task.embedding_size, task.vocab_size) == (4096, 128, 30000)
    assert task.max_seq_length == 512 and task.short_seq_probability == 0.0  # as the authors' example builder
    assert task.learning_rate == pytest.approx(0.00176)
    assert list(task.betas) == [0.9, 0.999] and task.eps == pytest.approx(1e-6)
    assert task.weight_decay == pytest.approx(0.01) and task.max_grad_norm == pytest.approx(1.0)
    assert (task.warmup_steps, task.total_steps) == (5000, 1_000_000)  # the authors' max_steps
    assert config.training.max_global_steps == 125_000
    assert config.collaboration.target_batch_size == 4096
    assert config.collaboration.averaging_timeout == pytest.approx(120.0)
    assert config.collaboration.compression is Compression.fp16


def test_overrides_apply():
    config = load_config(TINY, ["training.max_global_steps=3", "collaboration.semantics=dpu"])
    assert config.training.max_global_steps == 3
    assert config.collaboration.semantics is Semantics.dpu
    single = load_config(TINY, ["training.backend=single", "collaboration.semantics=dpu"])  # dpu's reference
    assert single.training.backend is Backend.single and single.collaboration.semantics is Semantics.dpu


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["training.max_global_stepz=3"], "max_global_stepz"),
        (["training.local_batch_size=many"], "local_batch_size"),
        (["training.local_batch_size=0"], "training.local_batch_size must be > 0"),
        (["collaboration.semantics=eventual"], "semantics"),
        (["task.hidden_size=100", "task.num_attention_heads=3"], "divisible"),
        (["task.mlm_probability=1.5"], "task.mlm_probability"),
        (["collaboration.agreement_tolerance=0"], "collaboration.agreement_tolerance must be > 0"),
        (["collaboration.next_chunk_timeout=30"], "below collaboration.averaging_timeout"),  # tiny: 30 s
        (["training.backend=ddp", "collaboration.semantics=dpu"], "training.backend=ddp supports"),
        (["training.backend=single", "collaboration.semantics=local"], "supports collaboration.semantics sync or dpu"),
        (["task_module=nonexistent"], "nonexistent"),
        (["not_an_override"], "key=value"),
    ],
)
def test_bad_values_raise_one_line_config_errors(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, overrides)
    message = str(error.value)
    assert fragment in message
    assert "\n" not in message


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("task_module: albert\ntask: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(broken)


def test_entry_point_reports_bad_config_in_one_line_without_traceback():
    result = run_script("scripts/train.py", "--config", str(TINY), "training.bogus_key=1", timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "bogus_key" in error_lines[0]
