"""Bad input ends with one line naming the problem, a non-zero exit code, and no traceback."""

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from common.checkpoints import load_latest_checkpoint, read_state_file, save_checkpoint
from common.config import load_config
from common.errors import ConfigError, DataError
from common.precision import resolve_precision
from tests.helpers import ROOT, run_script

TINY = str(ROOT / "configs/albert/tiny.yaml")
SOME_PEER_ID = "12D3KooWJFEFvnSerdP6CScJEQvA674MDJJgEWJ5HrMqv4eAnVSj"


def assert_one_line_error(result, fragment: str) -> None:
    assert result.returncode == 2, result.stderr[-1500:]
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-1500:]
    assert fragment in errors[0], errors[0]


@pytest.mark.parametrize(
    "script, arguments, fragment",
    [
        ("scripts/train.py", ["task.corpus=/nonexistent/wikitext"], "data path not found"),
        ("scripts/train.py", ["--initial-peers", "not-a-multiaddr"], "malformed initial peer"),
        ("scripts/train.py", ["--initial-peers", "/ip4/127.0.0.1/tcp/9"], "lacks the /p2p/"),
        ("scripts/train.py", ["network.client_mode=true"], "client-mode peer"),
        ("scripts/aux_peer.py", ["network.client_mode=true"], "auxiliary peer must accept inbound"),
        # /sys refuses new folders even to root (a permission check would not stop root)
        ("scripts/train.py", ["training.output_dir=/sys/dedloc_run"], "cannot write or read /sys/dedloc_run"),
        pytest.param(
            "scripts/train.py",
            ["training.device=cuda"],
            "no usable CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU"),
        ),
    ],
)
def test_bad_input_is_one_line_error(script, arguments, fragment, preloaded_script):
    result = preloaded_script(script, "--config", TINY, "task.max_documents=500", *arguments, timeout=240)
    assert_one_line_error(result, fragment)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_unreachable_initial_peer_is_one_line_error():
    result = run_script(
        "scripts/train.py",
        "--config",
        TINY,
        "task.max_documents=500",
        "network.bootstrap_timeout=5",
        "network.startup_deadline=5",  # the start and the bootstrap are retried until then
        "--initial-peers",
        f"/ip4/127.0.0.1/tcp/9/p2p/{SOME_PEER_ID}",
        timeout=200,
    )
    assert result.returncode == 2, result.stderr[-1500:]
    assert "Traceback" not in result.stderr
    assert any(line.startswith("error:") and "initial peer" in line for line in result.stderr.splitlines())


def _write_bad_inputs(folder) -> dict:
    """Files a user might hand over by mistake: a YAML list, a file where a folder belongs, broken corpora."""
    paths = {
        name: folder / f"{name}.{suffix}"
        for name, suffix in (("list", "yaml"), ("a_file", "txt"), ("empty", "txt"), ("latin1", "txt"))
    }
    paths["list"].write_text("- task_module: albert\n- training: {}\n")
    paths["a_file"].write_text("not a folder\n")
    paths["empty"].write_bytes(b"")
    paths["latin1"].write_bytes("Un caf\u00e9 cr\u00e8me, s'il vous pla\u00eet.\n".encode("latin-1"))
    return paths


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "script, config, arguments, fragment",
    [
        ("scripts/train.py", "list", [], "must hold a mapping of sections"),
        ("scripts/train.py", None, ["training.output_dir={a_file}"], "training.output_dir must be a folder"),
        ("scripts/train.py", None, ["training.output_dir={a_file}/run"], "training.output_dir must be a folder"),
        ("scripts/monitor.py", None, ["monitor.checkpoint_dir={a_file}"], "monitor.checkpoint_dir must be a folder"),
        ("scripts/train.py", None, ["task.corpus={empty}"], "is empty"),
        ("scripts/train.py", None, ["task.corpus={latin1}"], "is not UTF-8 text"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, script, config, arguments, fragment, preloaded_script):
    paths = _write_bad_inputs(tmp_path)
    config_path = str(paths[config]) if config else TINY
    arguments = [argument.format(**paths) for argument in arguments]
    result = preloaded_script(script, "--config", config_path, "task.max_documents=500", *arguments, timeout=240)
    assert_one_line_error(result, fragment)
    assert "hub is unreachable" not in result.stderr  # a local file's problem is never blamed on the network


def test_bf16_on_a_gpu_without_bfloat16_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "Tesla T4")
    with pytest.raises(ConfigError, match="precision=bf16 needs a GPU with bfloat16 support and Tesla T4 has none"):
        resolve_precision("bf16", torch.device("cuda"))
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"  # CPU autocast has bfloat16


def _torn(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_corrupt_state_file_is_one_data_error_and_the_previous_checkpoint_serves(tmp_path, caplog):
    state = {"step": 1, "model": {"weight": torch.ones(3)}}
    first = save_checkpoint(tmp_path, 1, state, keep=3)
    second = save_checkpoint(tmp_path, 2, {**state, "step": 2}, keep=3)
    _torn(second)
    second.with_name(second.name + ".sha256").write_text(hashlib.sha256(second.read_bytes()).hexdigest())
    with pytest.raises(DataError, match=f"{second} is not a readable state file"):
        read_state_file(second)
    assert load_latest_checkpoint(tmp_path)["step"] == 1  # the torn one (with a matching digest) is skipped
    assert any("is not a readable state file" in record.getMessage() for record in caplog.records)
    assert read_state_file(first)["step"] == 1  # nothing lost


@pytest.mark.timeout(240)
def test_export_of_a_corrupt_checkpoint_is_one_line_error(tmp_path, preloaded_script):
    checkpoint = tmp_path / "step_0000002.pt"
    torch.save({"step": 2, "model": {}}, checkpoint)
    _torn(checkpoint)
    result = preloaded_script(
        "scripts/export_model.py",
        "--config",
        TINY,
        "--checkpoint",
        str(checkpoint),
        "--output",
        str(tmp_path / "exported"),
        "task.max_documents=500",
        timeout=200,
    )
    assert_one_line_error(result, "is not a readable state file")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed here")
def test_blockwise8bit_without_bitsandbytes_is_refused_at_load():
    with pytest.raises(ConfigError, match="compression=blockwise8bit needs the bitsandbytes package"):
        load_config(TINY, ["collaboration.compression=blockwise8bit"])
    assert load_config(TINY, ["collaboration.compression=uniform8bit"]).collaboration.compression == "uniform8bit"


def test_a_corpus_of_one_sentence_lines_is_one_line_error(tmp_path, preloaded_script):
    lines = [f"Sentence number {index} says one thing about the weather." for index in range(400)]
    corpus = tmp_path / "one_sentence_per_line.txt"
    corpus.write_text("\n".join(lines) + "\n")
    result = preloaded_script(
        "scripts/train.py",
        "--config",
        TINY,
        f"task.corpus={corpus}",
        f"task.cache_dir={tmp_path / 'cache'}",
        "task.vocab_size=200",
        f"training.output_dir={tmp_path / 'run'}",
        timeout=240,
    )
    assert_one_line_error(result, "none of its 400 documents has two sentences")


def test_an_unreadable_examples_cache_is_rebuilt(tmp_path, caplog):
    from common.text.cache import load_or_build_examples

    path = tmp_path / "examples-0123.pt"
    examples = {"input_ids": torch.arange(6).view(2, 3)}
    load_or_build_examples(path, lambda: examples)
    path.write_bytes(path.read_bytes()[:40])  # a truncated copy
    rebuilt = load_or_build_examples(path, lambda: {"input_ids": torch.ones(2, 3, dtype=torch.long)})
    assert torch.equal(rebuilt["input_ids"], torch.ones(2, 3, dtype=torch.long))
    assert "unreadable" in caplog.text and torch.equal(
        torch.load(path, weights_only=True)["input_ids"], rebuilt["input_ids"]
    )
