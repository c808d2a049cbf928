"""Start-up of a restarted peer on a busy machine whose initial peers are mostly stale: success rate over N tries.

One live peer listens on loopback; each try starts a DHT node as a restarted peer would (its identity file already
exists) with initial peers of which only the last is alive (the others: peer ids at closed ports, as a peer that
restarted on a new port leaves behind), while ``--hogs`` processes spin on every core. Writes a JSON artefact with
every try, the command, machine and date.

    python scripts/experiments/startup_under_load.py --tries 10 --hogs 6 --label after \
        --out paper_results/chaos/startup_under_load_after.json
"""

import argparse
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger("startup_under_load")


def git_state() -> dict:
    """The commit this run starts from, and the tracked files changed since (other sessions edit this checkout)."""

    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True).stdout

    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "uncommitted": git("status", "--porcelain", "-uno").splitlines(),
    }


def _network(initial_peers, identity_path, **options):
    from common.config import NetworkConfig

    return NetworkConfig(
        initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=identity_path, **options
    )


def serve(folder: Path) -> None:
    """The live peer: a DHT node on loopback until SIGTERM; its addresses in ``folder/addresses.txt``."""
    from common.dht import start_dht

    stop = StopFlag().install()
    dht = start_dht(_network([], str(folder / "identity.key")))
    (folder / "addresses.txt").write_text("\n".join(str(a) for a in dht.get_visible_maddrs()) + "\n")
    stop.wait()
    dht.shutdown()


def one_try(folder: Path, initial_peers, startup_deadline=None) -> None:
    """A restarted peer: its identity exists; start the DHT node, report, leave."""
    from common.dht import start_dht

    started = time.monotonic()
    options = {} if startup_deadline is None else {"startup_deadline": startup_deadline}
    dht = start_dht(_network(initial_peers, str(folder / "identity.key"), **options))
    logger.info(f"joined in {time.monotonic() - started:.1f} s")
    dht.shutdown()


def stale_address() -> str:
    """A peer id nobody runs, at a loopback port nobody listens on."""
    from common.identity import load_identity

    with tempfile.TemporaryDirectory() as folder:
        peer_id = load_identity(Path(folder) / "identity.key").peer_id
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"


def _spawn(args, log: Path) -> subprocess.Popen:
    with log.open("wb") as handle:
        return subprocess.Popen(
            [sys.executable, __file__, *args],
            cwd=ROOT,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def measure(args) -> dict:
    from common.identity import load_identity

    work = Path(tempfile.mkdtemp(prefix="startup_under_load_"))
    (work / "live").mkdir()
    live = _spawn(["--serve", str(work / "live")], work / "live.log")
    hogs, rows = [], []
    try:
        deadline = time.monotonic() + 120
        while not (work / "live" / "addresses.txt").exists():
            if live.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the live peer did not start:\n{(work / 'live.log').read_text()[-2000:]}")
            time.sleep(0.2)
        live_address = (work / "live" / "addresses.txt").read_text().split()[0]
        hogs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(args.hogs)
        ]
        for index in range(args.tries):
            folder = work / f"try{index}"
            load_identity(folder / "identity.key")  # a restart: the identity exists already
            peers = [stale_address() for _ in range(args.stale)] + [live_address]
            log = folder / "try.log"
            started = time.monotonic()
            process = _spawn(["--try", str(folder), *peers], log)
            try:
                code = process.wait(args.try_timeout)
            except subprocess.TimeoutExpired:
                code = None
            seconds = time.monotonic() - started
            _kill_group(process)
            lines = [line for line in log.read_text().splitlines() if line.strip()]
            error = next((line for line in reversed(lines) if line.startswith("error:")), "")
            tracebacks = sum("Traceback" in line for line in lines)
            rows.append(
                {
                    "try": index,
                    "exit_code": code,
                    "seconds": round(seconds, 1),
                    "error": error,
                    "tracebacks": tracebacks,
                }
            )
            logger.info(f"try {index}: exit {code} in {seconds:.1f} s {error}")
    finally:
        for hog in hogs:
            _kill_group(hog)
        live.send_signal(signal.SIGTERM)
        try:
            live.wait(30)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(live)
    successes = sum(row["exit_code"] == 0 for row in rows)
    return {
        "label": args.label,
        "command": " ".join(["python", "scripts/experiments/startup_under_load.py", *sys.argv[1:]]),
        "machine": f"{platform.node()}: {os.cpu_count()}-core CPU container, no GPU",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **args.git_state,
        "hogs": args.hogs,
        "stale_initial_peers": args.stale,
        "live_initial_peers": 1,
        "tries": len(rows),
        "successes": successes,
        "rows": rows,
    }


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--hogs", type=int, default=6, help="CPU-spinning processes during the tries")
    parser.add_argument("--stale", type=int, default=2, help="dead initial peers listed before the live one")
    parser.add_argument("--try-timeout", type=float, default=180.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--try", dest="try_folder", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--startup-deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    setup_logging("startup")
    if args.serve is not None:
        return serve(args.serve)
    if args.try_folder is not None:
        return one_try(Path(args.try_folder[0]), args.try_folder[1:], args.startup_deadline)
    args.git_state = git_state()
    result = measure(args)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    logger.info(f"{result['successes']}/{result['tries']} tries joined")


if __name__ == "__main__":
    main()
