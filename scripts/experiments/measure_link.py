"""Measure an emulated link through hivemind p2p: two hosts, one rate-capped, a timed transfer each way.

    python scripts/experiments/measure_link.py --upload-mbit 50 --download-mbit 20 [--seconds 2] [--json out.json]

Builds two network namespaces (needs root; see common/tools/netns.py), caps host 0's link, starts a DHT peer
serving the bandwidth probe on host 1, and measures from a peer on host 0 (optionally in client mode,
behind a no-inbound firewall). Prints declared vs measured Mbit/s.
"""

import argparse
import csv
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from common.errors import PeerError, exit_on_user_error
from common.lifecycle import setup_logging
from common.tools.netns import EmulatedNetwork, HostSpec

logger = logging.getLogger("measure_link")


def serve(host_maddr: str, address_file: Path) -> None:
    import hivemind

    from common.bandwidth import serve_bandwidth_probe

    dht = hivemind.DHT(host_maddrs=[host_maddr], start=True)
    serve_bandwidth_probe(dht)
    address_file.write_text("\n".join(str(address) for address in dht.get_visible_maddrs()) + "\n")
    signal.pthread_sigmask(
        signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT}
    )  # after the DHT forked: it must still die on TERM
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    dht.shutdown()


def measure(host_maddr: str, initial_peers: list, client_mode: bool, seconds: float, declared: float) -> dict:
    import hivemind

    from common.bandwidth import bandwidth_for_averager, measure_link_to_initial_peer

    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=[host_maddr], client_mode=client_mode, start=True)
    try:
        measurement = measure_link_to_initial_peer(dht, initial_peers[0], seconds)
        bandwidth_for_averager(declared, measurement)
        return {"upload_mbit": measurement.upload_mbit, "download_mbit": measurement.download_mbit}
    finally:
        dht.shutdown()


def wait_for_file(path: Path, process: subprocess.Popen, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        if process.poll() is not None:
            raise PeerError(f"the probe server exited with code {process.returncode} before publishing its address")
        time.sleep(0.1)
    raise PeerError(f"the probe server did not publish its address within {timeout:.0f} s")


def run_emulated(args) -> dict:
    hosts = [
        HostSpec(
            "measured",
            upload_mbit=args.upload_mbit,
            download_mbit=args.download_mbit,
            accepts_inbound=not args.client_mode,
        ),
        HostSpec("server"),
    ]
    script = str(Path(__file__).resolve())
    with EmulatedNetwork(hosts) as network, TemporaryDirectory() as workdir:
        address_file = Path(workdir) / "server_addresses.txt"
        server = subprocess.Popen(
            network.command_prefix(1) + [sys.executable, script, "--serve", network.host_maddr(1), str(address_file)],
            start_new_session=True,
        )
        try:
            initial_peers = wait_for_file(address_file, server, timeout=60)
            client = subprocess.run(
                network.command_prefix(0)
                + [
                    sys.executable,
                    script,
                    "--measure",
                    network.host_maddr(0),
                    json.dumps(initial_peers),
                    "--seconds",
                    str(args.seconds),
                    "--upload-mbit",
                    str(args.upload_mbit),
                    "--download-mbit",
                    str(args.download_mbit),
                ]
                + (["--client-mode"] if args.client_mode else []),
                capture_output=True,
                text=True,
                timeout=60 + 4 * args.seconds,
            )
            if client.returncode != 0:
                raise PeerError(f"measurement failed: {client.stderr.strip().splitlines()[-1:]}")
            result = json.loads(client.stdout.strip().splitlines()[-1])
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    result.update(
        {
            "declared_upload_mbit": args.upload_mbit,
            "declared_download_mbit": args.download_mbit,
            "client_mode": args.client_mode,
            "seconds": args.seconds,
        }
    )
    return result


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--upload-mbit", type=float, default=50.0, help="cap on host 0's upload")
    parser.add_argument("--download-mbit", type=float, default=50.0, help="cap on host 0's download")
    parser.add_argument("--seconds", type=float, default=2.0, help="transfer time each way")
    parser.add_argument("--client-mode", action="store_true", help="host 0 accepts no inbound connections")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--csv", type=Path, help="also append the result as a row here")
    parser.add_argument("--serve", nargs=2, metavar=("HOST_MADDR", "ADDRESS_FILE"), help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=2, metavar=("HOST_MADDR", "PEERS_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    setup_logging("measure_link")
    for stop_signal in (signal.SIGINT, signal.SIGTERM):  # unwind through the cleanup in run_emulated
        signal.signal(stop_signal, lambda signum, _frame: sys.exit(128 + signum))
    if args.serve:
        serve(args.serve[0], Path(args.serve[1]))
        return
    if args.measure:
        result = measure(
            args.measure[0],
            json.loads(args.measure[1]),
            args.client_mode,
            args.seconds,
            min(args.upload_mbit, args.download_mbit),
        )
        sys.stdout.write(json.dumps(result) + "\n")
        return
    result = run_emulated(args)
    logger.info(
        f"declared up {args.upload_mbit} / down {args.download_mbit} Mbit/s; measured up "
        f"{result['upload_mbit']:.1f} / down {result['download_mbit']:.1f} Mbit/s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.csv:
        write_header = not args.csv.exists()
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(result))
            if write_header:
                writer.writeheader()
            writer.writerow(result)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
