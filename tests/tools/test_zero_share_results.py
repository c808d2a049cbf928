"""A slow full peer that the load balancer gives no share of the all-reduce overlaps its upload and download.

hivemind 1.1.12 holds back such a peer's averaged parts until it has sent its whole vector (it mistakes a share of
0 for client mode); the fix stream_results_to_zero_share_full_peers (common/hivemind_patches/fixes.py) undoes that
for full peers; the benchmark leaves it out for its "after-sending" rows.
"""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from common.tools.netns import list_namespaces
from tests.helpers import ROOT, leftover_namespaces, needs_network_namespaces

SCRIPT = ROOT / "scripts" / "experiments" / "averaging_benchmark.py"
# 1 M parameters in fp16 = 2 MB: 1.6 s one way over a 10 Mb/s link, so the links, not the CPU, set the round time
SETUP = (
    "name: fast1_slow2\nhosts:\n"
    "  - {name: fast, upload_mbit: 200, download_mbit: 200}\n"
    "  - {name: slow0, upload_mbit: 10, download_mbit: 10}\n"
    "  - {name: slow1, upload_mbit: 10, download_mbit: 10}\n"
)


def median_balanced_round(tmp_path: Path, zero_share_results: str) -> dict:
    output = tmp_path / zero_share_results
    before = set(list_namespaces())
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--setups",
            str(tmp_path / "setup.yaml"),
            "--params",
            "1000000",
            "--rounds",
            "2",
            "--splits",
            "balanced",
            "--zero-share-results",
            zero_share_results,
            "--output-dir",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not leftover_namespaces(before), "namespaces left behind"
    with (output / "averaging_peers.csv").open() as handle:
        peers = list(csv.DictReader(handle))
    with (output / "averaging.csv").open() as handle:
        (row,) = list(csv.DictReader(handle))
    row["slow_shares"] = {float(peer["share_planned"]) for peer in peers if peer["host"].startswith("slow")}
    return row


@needs_network_namespaces
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_slow_full_peers_get_results_while_they_send(tmp_path):
    (tmp_path / "setup.yaml").write_text(SETUP)
    held_back = median_balanced_round(tmp_path, "after-sending")
    streamed = median_balanced_round(tmp_path, "streamed")
    for row in held_back, streamed:
        assert row["rounds_ok"] == "2"
        assert float(row["max_relative_l2_error"]) < 1e-3  # the exact average, fp16 on the wire
        assert row["slow_shares"] == {0.0}  # the balancer leaves the slow peers nothing to reduce
    # held back: upload, then download (~2 x 1.6 s); streamed: both at once (~1.6 s + overheads)
    assert float(streamed["round_s_median"]) < 0.8 * float(held_back["round_s_median"]), (streamed, held_back)
