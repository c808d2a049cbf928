"""Bad input ends with one line naming the problem, a non-zero exit code, and no traceback."""

import pytest

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
    ],
)
def test_bad_input_is_one_line_error(script, arguments, fragment):
    result = run_script(script, "--config", TINY, "task.max_documents=500", *arguments, timeout=240)
    assert_one_line_error(result, fragment)


@pytest.mark.timeout(240)
def test_unreachable_initial_peer_is_one_line_error():
    result = run_script(
        "scripts/train.py",
        "--config",
        TINY,
        "task.max_documents=500",
        "network.bootstrap_timeout=5",
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
def test_bad_files_are_one_line_errors(tmp_path, script, config, arguments, fragment):
    paths = _write_bad_inputs(tmp_path)
    config_path = str(paths[config]) if config else TINY
    arguments = [argument.format(**paths) for argument in arguments]
    result = run_script(script, "--config", config_path, "task.max_documents=500", *arguments, timeout=240)
    assert_one_line_error(result, fragment)
    assert "hub is unreachable" not in result.stderr  # a local file's problem is never blamed on the network
