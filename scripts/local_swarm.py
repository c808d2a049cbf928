"""Run a whole collaborative run on this machine: a monitor, N trainers and auxiliary peers, each its own process.

    python scripts/local_swarm.py --config configs/albert/tiny.yaml --trainers 3 --aux 1 [key=value ...]

Shows progress while it runs and ends with a report (also in <output>/summary.json and loss_curve.png).
"""

import contextlib
import json
import logging
import time
from pathlib import Path

from common.config import load_config, script_argument_parser
from common.dashboard import URL_FILE as DASHBOARD_URL_FILE
from common.errors import UserError, exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.metrics import HistoryWriter
from common.report import build_report, format_report
from common.swarm import LocalSwarm

logger = logging.getLogger("local_swarm")


def parse_arguments():
    parser = script_argument_parser(__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--aux", type=int, default=1, help="auxiliary peers")
    parser.add_argument("--output", default=None, help="run folder (default: training.output_dir from the config)")
    parser.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    parser.add_argument(
        "--network-setup",
        default=None,
        help="configs/network/*.yaml: run every peer in its own network namespace with that host's "
        "rate limits (needs root); --trainers/--aux then come from the setup's hosts",
    )
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args()


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    args = parse_arguments()
    setup_logging("swarm")
    if args.trainers < 1 or args.aux < 0:
        raise UserError("--trainers must be >= 1 and --aux >= 0")
    config = load_config(args.config, args.overrides)  # fail fast, before any process starts
    output = Path(args.output or config.training.output_dir)
    network = None
    if args.network_setup:
        from common.tools.netns import EmulatedNetwork, load_network_setup

        setup = load_network_setup(args.network_setup)
        roles = {host.name: host.role for host in setup.hosts}
        monitor_name = next((name for name, role in roles.items() if role == "monitor"), None)
        if monitor_name is None:
            raise UserError(f"network setup {args.network_setup} has no host with role: monitor")
        trainer_names = [name for name, role in roles.items() if role == "trainer"]
        aux_names = [name for name, role in roles.items() if role == "auxiliary"]
        network = EmulatedNetwork(setup.hosts)
    else:
        monitor_name = "monitor"
        trainer_names = [f"trainer{index}" for index in range(args.trainers)]
        aux_names = [f"aux{index}" for index in range(args.aux)]
    # the demo's live page: on, on any free port (the URL is printed); the user's own overrides still win
    page = ["monitor.dashboard=true", "monitor.dashboard_port=0"] if network is None else []
    overrides = [*page, *args.overrides, f"collaboration.expected_peers={len(trainer_names)}"]
    started = time.time()
    max_steps = config.training.max_global_steps

    def show_progress() -> None:
        history = HistoryWriter(output / monitor_name).read()
        if not history:
            logger.info(f"{time.time() - started:.0f} s: waiting for the first global step")
            return
        step, elapsed = history[-1]["step"] + 1, time.time() - started
        eta = (max_steps - step) * elapsed / step
        logger.info(
            f"global step {step}/{max_steps} | loss {history[-1]['loss']:.4f} | "
            f"{history[-1]['peers']} trainers | elapsed {elapsed:.0f} s | ETA {eta:.0f} s"
        )

    with contextlib.ExitStack() as stack:
        if network is not None:
            stack.enter_context(network)
            logger.info("emulated hosts: " + "; ".join(f"{name}: {link}" for name, link in network.describe().items()))
        swarm = stack.enter_context(
            LocalSwarm(
                args.config,
                output,
                overrides,
                command_prefix=network.command_prefix_for if network is not None else None,
                host_overrides=network.peer_overrides if network is not None else None,
            )
        )
        swarm.start_first_peer("monitor", monitor_name)
        logger.info(f"monitor is up at {swarm.initial_peers[0]}")
        page_url = output / monitor_name / DASHBOARD_URL_FILE
        if page_url.exists():
            logger.info(f"live page of the run (open it in a browser): {page_url.read_text().strip()}")
        for name in aux_names:
            swarm.start("auxiliary", name)
        for name in trainer_names:
            swarm.start("trainer", name)
        swarm.wait(
            trainer_names, timeout=args.timeout, on_tick=show_progress, tick_seconds=15, should_stop=stop.is_set
        )
        finished = not any(swarm.peers[name].alive() for name in trainer_names)
        timed_out = not finished and not stop.is_set()
        if timed_out:
            logger.error(f"the trainers did not finish within --timeout {args.timeout:.0f} s; stopping the swarm")
        elif not finished:
            logger.warning(f"stopping before the trainers finished ({stop.signal_name})")
        swarm.stop_many(trainer_names)
        time.sleep(2 * config.monitor.refresh_seconds + 1)  # let the monitor record the last steps
        swarm.stop_many([name for name in swarm.peers if name not in trainer_names])
        failed = {name: peer.process.returncode for name, peer in swarm.peers.items() if peer.process.returncode}
    report = build_report(
        output, trainer_names, monitor_name, time.time() - started, config.collaboration.agreement_tolerance
    )
    report["exit_codes"] = failed
    (output / "summary.json").write_text(json.dumps(report, indent=2))
    logger.info("run report (%s):\n%s", output / "summary.json", format_report(report))
    logger.info(f"loss curve: {output / 'loss_curve.png'}")
    if failed:
        logger.warning(f"peers that exited with errors: {failed} (see <run>/<peer>/peer.log)")
    if timed_out:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
