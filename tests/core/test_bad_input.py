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
