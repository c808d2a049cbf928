"""Addresses in ranges reserved for documentation and benchmarks (192.0.2.0/24 ...): what works through them and what
does not, and a monitor that has only such addresses prints no join command but says what to announce."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from common.peer import ADDRESS_FILE, JOIN_COMMAND_FILE
from tests.helpers import PYTHON, ROOT, TINY_ALBERT

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)

# Four p2pd daemons on one address of the namespace: second and fourth join through first; third lists first and
# second. Each line: who opened a stream to whom, and what the attempt said.
DIRECT_OR_BY_ID_PROBE = """
import asyncio, sys
from hivemind.p2p import P2P

async def said(source, target):
    try:
        await source.call_binary_stream_handler(target.peer_id, "no_such_handler")
    except Exception as error:
        return " ".join(str(error).split())

async def main(prefix):
    listen = dict(host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    pick = lambda addresses: [a for a in addresses if str(a).startswith("/ip4/" + prefix)]
    first = await P2P.create(**listen)
    second = await P2P.create(initial_peers=pick(await first.get_visible_maddrs()), **listen)
    both = pick(await first.get_visible_maddrs()) + pick(await second.get_visible_maddrs())
    third = await P2P.create(initial_peers=both, **listen)
    fourth = await P2P.create(initial_peers=pick(await first.get_visible_maddrs()), **listen)
    await asyncio.sleep(1)
    pairs = {"third>second": (third, second), "second>third": (second, third), "first>fourth": (first, fourth),
             "fourth>second": (fourth, second), "second>fourth": (second, fourth)}
    for name, (source, target) in pairs.items():
        print(name, await said(source, target))
    for peer in (fourth, third, second, first):
        await peer.shutdown()

asyncio.run(main(sys.argv[1]))
"""

REACHED = "protocols not supported"  # the stream reached the peer, which has no such handler


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "address, routed", [("192.0.2.9/24", False), ("203.0.113.9/24", False), ("10.99.0.9/8", True)]
)
def test_reserved_ranges_reach_directly_connected_peers_only(address, routed):
    prefix = address.split("/")[0].rsplit(".", 1)[0] + "."
    script = f"ip link set lo up && ip addr add {address} dev lo && {PYTHON} -c '{DIRECT_OR_BY_ID_PROBE}' {prefix}"
    result = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=200)
    outcomes = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert len(outcomes) == 5, result.stderr[-2000:]
    for pair in ("third>second", "second>third", "first>fourth"):  # one of the two dialled the other
        assert REACHED in outcomes[pair], (pair, outcomes)
    for pair in ("fourth>second", "second>fourth"):  # never connected: found by peer id, or not at all
        assert (REACHED in outcomes[pair]) == routed, (pair, outcomes)
        assert ("routing: not found" in outcomes[pair]) != routed, (pair, outcomes)


def _monitor_in_namespace(address: str, folder) -> subprocess.Popen:
    command = " ".join(
        [
            PYTHON,
            "scripts/monitor.py",
            "--config",
            TINY_ALBERT,
            f"training.output_dir={folder}",
            "monitor.wandb_mode=disabled",
            "monitor.checkpoint_every_steps=0",
            "task.max_documents=500",
        ]
    )
    log = (folder.parent / f"{folder.name}.log").open("wb")
    return subprocess.Popen(
        ["unshare", "-n", "sh", "-c", f"ip link set lo up && ip addr add {address} dev lo && exec {command}"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_monitor_with_only_reserved_addresses_prints_no_join_command_and_says_what_to_announce(tmp_path):
    folders = {"reserved": tmp_path / "reserved", "private": tmp_path / "private"}
    monitors = {
        "reserved": _monitor_in_namespace("192.0.2.9/24", folders["reserved"]),
        "private": _monitor_in_namespace("10.99.0.9/8", folders["private"]),
    }
    try:
        deadline = time.monotonic() + 300
        while not all((folder / ADDRESS_FILE).exists() for folder in folders.values()):
            for name, process in monitors.items():
                assert process.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, [(tmp_path / f"{name}.log").read_text()[-2000:] for name in folders]
            time.sleep(0.5)
        time.sleep(1)
    finally:
        for process in monitors.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
        codes = {name: process.wait(60) for name, process in monitors.items()}
        for process in monitors.values():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in folders}
    assert codes == {"reserved": 0, "private": 0}, logs
    assert "Traceback" not in logs["reserved"] + logs["private"]

    refused = [line for line in logs["reserved"].splitlines() if "no join command" in line]
    assert len(refused) == 1 and " WARN" in refused[0], logs["reserved"][-3000:]
    assert "192.0.2.9" in refused[0] and "network.announce_maddrs=" in refused[0]
    assert not (folders["reserved"] / JOIN_COMMAND_FILE).exists()
    # peers on the same machine may still join it, through loopback
    assert any("/ip4/127.0.0.1/" in line for line in (folders["reserved"] / ADDRESS_FILE).read_text().split())

    clone, command = (folders["private"] / JOIN_COMMAND_FILE).read_text().strip().splitlines()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert clone.startswith("git clone ") and clone.endswith(f"git checkout --quiet {head}"), clone
    assert "configs/albert/tiny.yaml --initial-peers /ip4/10.99.0.9/" in command, command
    listing = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout
    assert not listing.strip(), listing
