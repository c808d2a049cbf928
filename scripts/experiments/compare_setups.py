"""Collaborative training vs the HPC baseline on this machine, with the same config, seed and number of samples.

    python scripts/experiments/compare_setups.py            # tiny ALBERT, 250 steps x 256, 2 workers: ~60 min
    python scripts/experiments/compare_setups.py --reduced  # CI-sized: a few steps, ~3-4 min on a quiet 2-core box
    python scripts/experiments/compare_setups.py --workers 3 [key=value ...]
    python scripts/experiments/compare_setups.py --diloco-inner-steps 8 32 --setups collab_sync collab_diloco_h8 ...
    python scripts/experiments/compare_setups.py --network-setup configs/network/paper_mix.yaml --eval-every 5 ...

Runs, one after the other: one process (training.backend=single), one process applying each update a step late
as `dpu` does (single_dpu), torch DDP with N gloo workers (training.backend=ddp through torchrun), and a local
hivemind swarm (monitor + N trainers) for each semantics (sync, dpu, local, and diloco once per
--diloco-inner-steps value). Writes into --output: curves.csv (loss per global step vs samples seen and wall
time), summary.csv (with the TCP bytes each setup's trainers sent and their compute utilisation), loss_curves.png
and results.md (the exact command, the machine and its load, the table). --eval-every K also scores the checkpoints
each setup saves every K global steps (a swarm's: the monitor's) on the same held-out batches: heldout.csv and
heldout_curves.png. --network-setup runs every swarm's peers each on its own emulated host of that setup (its
link caps, as local_swarm.py --network-setup; needs root), and counts the bytes each trainer's host sent from its
own network namespace; one process and DDP still run on this machine's loopback.
"""

import logging
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from common.config import load_config, script_argument_parser
from common.errors import ConfigError, exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.tools.comparison import (
    SEMANTICS,
    SOCKET_POLL_SECONDS,
    EmulatedHosts,
    add_baseline_differences,
    add_equal_sample_scores,
    all_setups,
    curve_rows,
    evaluate,
    evaluation_batches,
    finished_run,
    heldout_curve,
    parse_diloco_setup,
    plot_curves,
    plot_heldout,
    plot_title,
    run_setup,
    summarize,
    summary_table,
    write_csv,
)
from common.tools.provenance import git_commit, machine_description

logger = logging.getLogger("compare_setups")

# Quiet peers and no checkpoints: the comparison is about training, not the monitor's side jobs.
COMMON_OVERRIDES = [
    "monitor.wandb_mode=disabled",
    "monitor.checkpoint_every_steps=0",
    "monitor.refresh_seconds=0.5",
    "training.log_every_seconds=10",
    "training.num_threads=1",
    # 5 % of the documents are never trained on: every final model is scored on them (task.heldout_fraction)
    "task.heldout_fraction=0.05",
]
# The full run: the demo's recipe (configs/albert/tiny.yaml: LAMB 0.02, 10 warmup steps, 256 samples per step) for
# 250 global steps (64,000 samples per setup), the schedule ending just after them: far enough past ALBERT's unigram
# plateau (left at ~60 steps with this recipe) to compare models that use context.
FULL_OVERRIDES = [
    "training.max_global_steps=250",
    "task.total_steps=275",
]
REDUCED_OVERRIDES = [
    "training.max_global_steps=4",
    "collaboration.target_batch_size=64",
    "training.local_batch_size=16",
    "task.max_documents=3000",
    "task.warmup_steps=1",
    "collaboration.matchmaking_time=1.5",
    "collaboration.averaging_timeout=20",
]


def parse_arguments():
    parser = script_argument_parser(__doc__)
    parser.add_argument("--config", default="configs/albert/tiny.yaml")
    parser.add_argument("--workers", type=int, default=2, help="DDP workers (and collaborative trainers by default)")
    parser.add_argument("--trainers", type=int, default=None, help="collaborative trainers (default: --workers)")
    parser.add_argument("--reduced", action="store_true", help="few steps on a small corpus (CI)")
    parser.add_argument(
        "--setups",
        nargs="+",
        default=None,
        help=f"run only these (default: single single_dpu ddp {' '.join('collab_' + s for s in SEMANTICS)})",
    )
    parser.add_argument(
        "--diloco-inner-steps",
        nargs="*",
        default=[],
        help="a collab_diloco_h<H> setup (semantics=diloco, collaboration.inner_steps=H) for each H given; "
        "H:LR: collab_diloco_h<H>_lr<LR>, with collaboration.outer_lr=LR",
    )
    parser.add_argument("--output", default="paper_results/comparison", help="CSV, PNG and results.md go here")
    parser.add_argument("--runs", default="outputs/compare", help="run folders (logs, histories, final models)")
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        help="fixed evaluation micro-batches scored for every final model (default 8 reduced, 32 full)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also score a checkpoint every this many global steps (held-out curves); 0: final models only",
    )
    parser.add_argument(
        "--network-setup",
        default=None,
        help="configs/network/*.yaml: each swarm peer on its own emulated host with that host's link "
        "(needs root); the trainers are the setup's trainer hosts",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per setup")
    parser.add_argument(
        "--reuse-finished",
        action="store_true",
        help="a setup whose run folder holds a finished run of exactly this command is scored, not rerun",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every setup")
    return parser.parse_args()


def eval_every_overrides(every: int) -> list:
    """Checkpoints every ``every`` global steps, all kept: the baselines' own and the monitor's of each swarm."""
    if every < 0:
        raise ConfigError(f"--eval-every must be >= 0 (got {every})")
    if every == 0:
        return []
    return [
        f"training.checkpoint_every_steps={every}",
        "training.keep_checkpoints=100000",
        f"monitor.checkpoint_every_steps={every}",
        "monitor.keep_checkpoints=100000",
    ]


def emulated_hosts(path: str, trainers_asked: int | None) -> EmulatedHosts:
    """The network setup a swarm runs on, checked before any process starts."""
    from common.tools.netns import check_available, load_network_setup

    setup = load_network_setup(path)
    roles = [host.role for host in setup.hosts]
    if [host.name for host in setup.hosts if host.role == "monitor"] != ["monitor"]:
        raise ConfigError(f"--network-setup {path}: needs exactly one host with role: monitor, named monitor")
    if trainers_asked is not None and trainers_asked != roles.count("trainer"):
        raise ConfigError(
            f"--trainers {trainers_asked} differs from the {roles.count('trainer')} trainer hosts of {path} "
            f"(leave --trainers out: the network setup decides)"
        )
    check_available(need_firewall=any(not host.accepts_inbound for host in setup.hosts))
    return EmulatedHosts(path, setup)


def load_text(load: tuple) -> str:
    return "/".join(f"{value:.2f}" for value in load)


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    args = parse_arguments()
    setup_logging("compare")
    torch.set_num_threads(1)
    network = emulated_hosts(args.network_setup, args.trainers) if args.network_setup else None
    trainers = args.trainers or args.workers
    if network is not None:
        trainers = sum(host.role == "trainer" for host in network.setup.hosts)
    if min(args.workers, trainers) < 2:
        raise ConfigError("--workers and --trainers must be >= 2 (a baseline and a swarm need at least two workers)")
    overrides = [
        *COMMON_OVERRIDES,
        *(REDUCED_OVERRIDES if args.reduced else FULL_OVERRIDES),
        *eval_every_overrides(args.eval_every),
        *args.overrides,
    ]
    config = load_config(args.config, overrides)  # fail fast, before any process starts
    target, local_batch = config.collaboration.target_batch_size, config.training.local_batch_size
    if target % (local_batch * args.workers):
        raise ConfigError(
            f"collaboration.target_batch_size ({target}) must be a multiple of "
            f"training.local_batch_size x --workers ({local_batch} x {args.workers}) for the DDP baseline"
        )
    try:
        diloco = [parse_diloco_setup(text) for text in args.diloco_inner_steps]
    except ValueError as error:
        raise ConfigError(f"--diloco-inner-steps: {error}") from None
    known = {setup.name: setup for setup in all_setups(diloco)}
    unknown = sorted(set(args.setups or []) - set(known))
    if unknown:
        raise ConfigError(f"--setups: unknown setup(s) {', '.join(unknown)} (choose from {', '.join(known)})")
    setups = [known[name] for name in args.setups] if args.setups else list(known.values())
    output, runs = Path(args.output), Path(args.runs)
    output.mkdir(parents=True, exist_ok=True)
    steps = config.training.max_global_steps
    logger.info(
        f"comparing {', '.join(setup.name for setup in setups)}: {steps} global steps x {target} samples, "
        f"{args.workers} DDP workers, {trainers} trainers, seed {config.training.seed}"
    )

    eval_batches = args.eval_batches or (8 if args.reduced else 32)
    # built first: a run is reused only if it was trained on the inputs these evaluation batches are made of
    task, batches, evaluation_data = evaluation_batches(config, eval_batches)
    inputs = task.input_fingerprint()

    started, load_before = datetime.now(timezone.utc), os.getloadavg()
    finished_runs, reused = [], []
    for index, setup in enumerate(setups, start=1):
        workers = trainers if setup.kind == "collaborative" else args.workers
        run_dir = runs / setup.name
        run = (
            finished_run(setup, args.config, overrides, run_dir, workers, inputs, network)
            if args.reuse_finished
            else None
        )
        if run is not None:
            logger.info(f"[{index}/{len(setups)}] {setup.name}: reusing the finished run in {run.run_dir}")
            reused.append(setup.name)
        else:
            logger.info(f"[{index}/{len(setups)}] {setup.name}: launching (load average {load_text(os.getloadavg())})")
            run = run_setup(
                setup, args.config, overrides, run_dir, workers, steps, args.timeout, stop, inputs, network
            )
        logger.info(f"[{index}/{len(setups)}] {setup.name}: done in {run.finished - run.launched:.0f} s")
        finished_runs.append(run)
    load_after = os.getloadavg()

    logger.info(f"scoring every final model on the same {eval_batches} evaluation batches of {local_batch}")
    curves, summaries, heldout = [], [], []
    for run in finished_runs:
        rows = curve_rows(run)
        curves.extend(rows)
        summaries.append(summarize(run, rows, evaluate(task, batches, run.final_model_path())))
        if args.eval_every:
            heldout.extend(heldout_curve(run, task, batches))
    add_baseline_differences(summaries)
    if heldout:
        add_equal_sample_scores(summaries, heldout)

    title = plot_title(setups, steps, target, args.workers, trainers)
    if network is not None:
        title += f", swarms on {network.setup.name}"
    write_csv(output / "curves.csv", curves)
    write_csv(output / "summary.csv", summaries)
    plot_curves(curves, output / "loss_curves.png", title)
    if heldout:
        write_csv(output / "heldout.csv", heldout)
        plot_heldout(heldout, output / "heldout_curves.png", title)
    command = " ".join(
        shlex.quote(part)
        for part in [Path(sys.executable).name, "scripts/experiments/compare_setups.py", *sys.argv[1:]]
    )
    table = summary_table(summaries)
    reused_line = (
        f"- Reused finished runs of this command (`--reuse-finished`; wall times and load from when they ran): "
        f"{', '.join(reused)}.\n"
        if reused
        else ""
    )
    hosts = network.setup.hosts if network is not None else []
    first_trainer = next((host.name for host in hosts if host.role == "trainer"), "trainer0")
    aux = sum(host.role == "auxiliary" for host in hosts)
    network_line = (
        f"- Swarms on emulated hosts: `{args.network_setup}` ({network.setup.description}), each peer in its own "
        f"network namespace; one process and DDP on this machine's loopback. A trainer's bytes sent per sample: "
        f"the TCP bytes its host sent to trainers and auxiliary peers (not to the monitor, whose history and "
        f"checkpoint downloads are no training traffic; read with `ss` in its namespace every "
        f"{SOCKET_POLL_SECONDS:g} s, a lower bound) / samples trained; link bytes: everything its link sent "
        f"(interface counter: headers, the monitor's share and short connections included).\n"
        if network is not None
        else ""
    )
    heldout_line = (
        f"- Held-out curves (heldout.csv, heldout_curves.png): every checkpoint saved each {args.eval_every} global "
        f"steps (a swarm's: the monitor's, of the state the swarm serves; diloco: the outer parameters) and the "
        f"final model, on the same evaluation batches, at the samples seen and wall time of the step reached.\n"
        if heldout
        else ""
    )
    (output / "results.md").write_text(
        f"# Collaborative vs HPC baseline: measured results\n\n"
        f"- Command: `{command}` (commit {git_commit()}), {started:%Y-%m-%d %H:%M} UTC, "
        f"{(datetime.now(timezone.utc) - started).total_seconds():.0f} s in all.\n"
        f"- Machine: {machine_description()}; container. Load average (1/5/15 min) {load_text(load_before)} before "
        f"and {load_text(load_after)} after: other jobs shared the cores unless these are below 1.\n"
        f"- Config: `{args.config}` with overrides `{' '.join(overrides)}`; {steps} global steps x {target} samples "
        f"= {steps * target} samples per setup; {args.workers} DDP workers (gloo), {trainers} collaborative trainers "
        f"(+ 1 monitor, {aux} auxiliary peer(s)); seed {config.training.seed} everywhere.\n"
        f"{network_line}"
        f"{heldout_line}"
        f"{reused_line}"
        f"- eval loss: each setup's final model (single: the process; ddp: worker 0; collaborative: its first "
        f"trainer, {first_trainer}) on the "
        f"same {eval_batches} micro-batches of {local_batch} from {evaluation_data}. "
        f"vs ddp: (eval loss - ddp eval loss) / ddp eval loss; vs one process, same updates: the same against "
        f"single for collab_sync and single_dpu for collab_dpu.\n"
        f"- samples/s steady: samples after the first global step / time between the first and last step; "
        f"end-to-end: all samples / wall time from launch to exit (includes data loading and peer start-up).\n"
        f"- bytes sent per sample: TCP bytes the training processes sent (the monitor's excluded; read from `ss` "
        f"every {SOCKET_POLL_SECONDS:g} s, so a lower bound) / samples trained; MB sent per trainer: the same "
        f"bytes / trainers (DDP: workers); computing: the trainers' mean share of wall time in forward and "
        f"backward passes; samples used: their mean share of computed samples that entered a global step.\n\n"
        f"{table}\n"
    )
    logger.info(f"results:\n{table}")
    logger.info(
        f"wrote {output / 'curves.csv'}, {output / 'summary.csv'}, {output / 'loss_curves.png'}, "
        f"{output / 'results.md'}"
    )


if __name__ == "__main__":
    main()
