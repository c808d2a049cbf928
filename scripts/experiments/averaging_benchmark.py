"""All-reduce over emulated volunteer links: round time vs the bandwidth lower bound.

    python scripts/experiments/averaging_benchmark.py \
        --setups configs/network/symmetric4.yaml configs/network/fast1_slow3.yaml \
        --params 2000000 --splits balanced uniform --aux without with --compression fp16 uniform8bit --rounds 3

For each network setup (``configs/network/*.yaml``, hosts built by common/tools/netns.py) one process per host runs
a hivemind ``DecentralizedAverager`` inside its namespace (trainer hosts hold data, ``aux`` hosts only help
reduce, hosts without inbound connections run in client mode). For every condition -- vector size, split
(``balanced``: each peer declares its link's Mbit/s to hivemind's load balancer; ``uniform``: all declare the
same), with or without the aux hosts, fp16 or 8-bit wire compression -- it times ``rounds`` all-reduce rounds
(after one warm-up) from the moment the group starts reducing until the last peer has the average.

Each round is set beside its bandwidth lower bound (``common/tools/allreduce.py`` derives it). Output: CSV,
PNG and a markdown table.
"""

import argparse
import itertools
import logging
import signal
import sys
import time
from pathlib import Path

from common.errors import ConfigError, exit_on_user_error
from common.lifecycle import setup_logging
from common.tools.allreduce import BYTES_PER_ELEMENT, Condition, run_setup, write_outputs
from common.tools.netns import load_network_setup

logger = logging.getLogger("averaging_benchmark")


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--setups", nargs="+", type=Path, default=[], help="configs/network/*.yaml")
    parser.add_argument(
        "--params", nargs="+", type=int, default=[2_000_000], help="vector sizes in elements (ALBERT-large: 18000000)"
    )
    parser.add_argument("--splits", nargs="+", choices=("balanced", "uniform"), default=["balanced"])
    parser.add_argument("--aux", nargs="+", choices=("with", "without"), default=["without"])
    parser.add_argument("--compression", nargs="+", choices=[c.value for c in BYTES_PER_ELEMENT], default=["fp16"])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per condition (after one warm-up)")
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--allreduce-timeout", type=float, default=60.0)
    parser.add_argument("--step-timeout", type=float, default=120.0)
    parser.add_argument("--setup-timeout", type=float, default=1800.0, help="give up on a setup after this long")
    parser.add_argument("--use-relay", type=int, choices=(0, 1), default=1, help="hivemind DHT use_relay")
    parser.add_argument("--use-auto-relay", type=int, choices=(0, 1), default=0, help="hivemind DHT use_auto_relay")
    parser.add_argument(
        "--server-mode-behind-firewall",
        action="store_true",
        help="peers on no-inbound hosts do NOT use client mode (shows why they must)",
    )
    parser.add_argument(
        "--zero-share-results",
        choices=("streamed", "after-sending"),
        default="streamed",
        help="streamed: what the trainers run (a full peer with no share of the all-reduce gets averaged parts "
        "while it sends); after-sending: hivemind 1.1.12 as is (only after it has sent its whole vector)",
    )
    parser.add_argument("--part-size-bytes", type=int, default=2**19, help="hivemind's all-reduce part size")
    parser.add_argument(
        "--sender-timeout", type=float, default=None, help="hivemind sender_timeout (reducer: 2x); default none"
    )
    parser.add_argument(
        "--trace-interval",
        type=float,
        default=0.0,
        help="sample link counters this often (s) into <stem>_*_traces.json",
    )
    parser.add_argument("--queue-ms", type=float, default=100.0, help="capped links' queue (tbf latency), ms")
    parser.add_argument(
        "--congestion-control", default="", help="TCP congestion control in the host namespaces ('' = kernel's)"
    )
    parser.add_argument(
        "--rtt-ms", type=float, default=0.0, help="added round-trip time between hosts (each delays sends by half)"
    )
    parser.add_argument(
        "--notsent-lowat",
        type=int,
        default=0,
        help="TCP's limit on not-yet-sent bytes per socket in every host namespace (0 = kernel default: unlimited)",
    )
    parser.add_argument("--pin-cpus", action="store_true", help="pin each host's processes to one core (taskset)")
    parser.add_argument("--variant", default="", help="a label for this run's rows (hypothesis tests)")
    parser.add_argument("--output-dir", type=Path, default=Path("paper_results/network"))
    parser.add_argument("--stem", default="averaging", help="output file names: <stem>.csv/.png/.md")
    args = parser.parse_args()
    setup_logging("averaging_benchmark")
    # a background job inherits SIGINT ignored: make both signals unwind through the cleanup in run_setup
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda signum, _frame: sys.exit(128 + signum))
    if not args.setups:
        raise ConfigError("give at least one --setups configs/network/<name>.yaml")
    if args.rounds < 1 or any(p < 1 for p in args.params):
        raise ConfigError("--rounds and --params must be >= 1")
    setups = [load_network_setup(path) for path in args.setups]
    rows, peer_rows = [], []
    for setup in setups:
        has_aux = any(host.role == "auxiliary" for host in setup.hosts)
        grid = itertools.product(
            args.params, args.compression, args.splits, [a for a in args.aux if a == "without" or has_aux]
        )
        conditions = [
            Condition(i, params, split, aux, compression) for i, (params, compression, split, aux) in enumerate(grid)
        ]
        started = time.monotonic()
        logger.info(f"setup {setup.name}: {len(conditions)} conditions x {args.rounds} rounds")
        setup_rows, setup_peer_rows = run_setup(setup, conditions, args)
        for row in setup_rows:
            logger.info(
                f"{row['setup']} {row['params']} {row['compression']} {row['split']} aux={row['aux']}: "
                f"{row['round_s_median']} s (bound {row['bound_optimal_s']} s, ratio "
                f"{row['ratio_to_optimal_bound']}, {row['rounds_ok']}/{row['rounds']} rounds ok)"
            )
        logger.info(f"setup {setup.name} took {time.monotonic() - started:.0f} s")
        rows.extend(setup_rows)
        peer_rows.extend(setup_peer_rows)
        write_outputs(
            rows, peer_rows, args.output_dir, args.stem
        )  # after every setup: an interrupted run keeps its results
        logger.info(f"wrote {args.output_dir / args.stem}.csv/.md/.png")


if __name__ == "__main__":
    main()
