"""Typed run configuration: omegaconf structured dataclasses, loaded from YAML + ``key=value`` overrides.

A run config has five experiment-independent sections (network, collaboration, training, monitor, debug) and a
``task`` section whose schema belongs to the experiment package named by ``task_module`` (``albert``,
``swav``, ...): that package's ``task`` module exposes ``TaskConfig``. Validation happens once, on load:
unknown keys, wrong types and out-of-range values become a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.errors import ConfigError


class Semantics(str, enum.Enum):
    """How hivemind.Optimizer applies the averaged update (the paper's section 3)."""

    sync = "sync"  # the paper: equivalent to synchronous large-batch training
    dpu = "dpu"  # delayed parameter updates: average and step in the background, one step stale
    local = "local"  # local optimizer steps, parameters (and optimizer statistics) averaged every target batch
    # local optimizer steps; every collaboration.inner_steps global steps the swarm averages the parameters' change
    # (the pseudo-gradient) and applies an outer Nesterov step to it (DiLoCo, common/optimizer.DiLoCoOptimizer)
    diloco = "diloco"


class Compression(str, enum.Enum):
    none = "none"
    fp16 = "fp16"
    scaled_fp16 = "scaled_fp16"
    uniform8bit = "uniform8bit"
    blockwise8bit = "blockwise8bit"


class Backend(str, enum.Enum):
    collaborative = "collaborative"  # hivemind peers
    single = "single"  # one process, gradient accumulation to the target batch
    ddp = "ddp"  # HPC baseline: torch DDP through accelerate


CONFIG_KEYS_HELP = (
    "Config keys: the sections network, collaboration, training, monitor and debug are listed with their "
    "defaults in common/config.py; the task section in the experiment's task.py (TaskConfig), e.g. "
    "albert/task.py. Override any key as key=value, e.g. training.max_global_steps=20."
)


def script_argument_parser(description: str) -> argparse.ArgumentParser:
    """The command line of a script that reads a run config and key=value overrides: ``description`` (the script's
    docstring) shown as written, and an epilog saying where the config keys are listed."""
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=CONFIG_KEYS_HELP
    )


def require(condition: bool, message: str) -> None:
    """Config validation in ``__post_init__``: the message names the key (omegaconf reports it in one line)."""
    if not condition:
        raise ValueError(message)


def require_directory_path(value: str, key: str) -> None:
    """An output folder must be creatable: no existing file may sit at it or at any folder above it."""
    for candidate in (Path(value), *Path(value).parents):
        if candidate.exists() and not candidate.is_dir():
            raise ValueError(f"{key} must be a folder, but {candidate} is a file (got {value!r})")


@dataclass
class NetworkConfig:
    initial_peers: List[str] = field(default_factory=list)
    # where to listen: every interface by default, so volunteers on other machines can dial in
    host_maddrs: List[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    # the addresses to announce instead of the listening ones: a public address (e.g. /ip4/203.0.113.5/tcp/31337)
    # when this machine is reached through port forwarding or a cloud VM's public IP
    announce_maddrs: List[str] = field(default_factory=list)
    client_mode: bool = False  # behind NAT/firewall: only outbound connections
    # RSA key file, the peer's identity (its peer id); default <training.output_dir>/identity.key, so a restarted
    # peer with the same output folder is the same contributor
    identity_path: Optional[str] = None
    use_relay: bool = True
    use_auto_relay: bool = False
    bootstrap_timeout: float = 30.0
    # how long one start of the p2p daemon may take (hivemind's 15 s is too short on a busy laptop)
    daemon_start_timeout: float = 60.0
    # the daemon start and the bootstrap are retried with backoff for this many seconds before the peer gives up
    startup_deadline: float = 300.0
    # a peer that accepts connections listens on the same port after a restart (kept in its output folder), so
    # the addresses it published stay valid; only ``tcp/0`` host addresses are pinned
    keep_port: bool = True

    def __post_init__(self) -> None:
        require(self.bootstrap_timeout > 0, "network.bootstrap_timeout must be > 0")
        require(self.daemon_start_timeout > 0, "network.daemon_start_timeout must be > 0")
        require(self.startup_deadline >= 0, "network.startup_deadline must be >= 0")
        require(len(self.host_maddrs) > 0, "network.host_maddrs must list at least one multiaddr")


@dataclass
class CollaborationConfig:
    run_id: str = "dedloc"
    target_batch_size: int = 4096
    semantics: Semantics = Semantics.sync
    compression: Compression = Compression.fp16
    bandwidth: Optional[float] = None  # declared Mbit/s for the load balancer; None = swarm average
    measure_bandwidth: bool = False  # measure this peer's link to its first initial peer and use that instead
    bandwidth_probe_seconds: float = 2.0
    matchmaking_time: float = 5.0
    averaging_timeout: float = 60.0
    # how long an all-reduce waits for a groupmate's next chunk before dropping that peer's part (hivemind's
    # next_chunk_timeout; its results get twice as long); None: matchmaking_time. A groupmate that starts its
    # share late, e.g. on a busy CPU, needs more; a crashed one is then dropped that much later
    next_chunk_timeout: Optional[float] = None
    average_state_every: int = 1
    # the most peers one averaging round (gradients, parameters, diloco's pseudo-gradients) holds: a larger
    # matchmaking splits into groups of at most this many, each averaging on its own (hivemind's target_group_size;
    # it recommends a power of two such as 16). None: no cap, a group is whoever matched within matchmaking_time.
    # On a swarm of up to 16 peers leave it unset (paper_results/scale: a cap of 4 at 8 peers only split groups)
    target_group_size: Optional[int] = None
    # the most state downloads (newcomers, peers that fell behind) this peer serves at once; a request beyond them
    # is turned away at once and its peer asks the next one (common/hivemind_patches/uploads.py, hivemind#169).
    # None: no limit (hivemind's behaviour). On a slow uplink (a few Mbit/s) 1 keeps one download going at a time
    # instead of several that all stall (paper_results/scale, the slow-donor storms)
    max_concurrent_state_uploads: Optional[int] = None
    # a trainer one step behind the swarm right after its own update catches up by stepping instead of downloading
    # the swarm's state and dropping its accumulated gradients (common/hivemind_compat.catch_up_one_step_behind);
    # measured over three seeds with dpu and sync semantics: it keeps every trainer in nearly every gradient round
    catch_up_one_step_behind: bool = False
    load_state_timeout: float = 60.0  # seconds one attempt to download the swarm's state may take
    # a peer that cannot download the swarm's state (joining, or after falling behind) retries with backoff and
    # stops with one line after this many seconds in all
    load_state_deadline: float = 300.0
    # a trainer that reaches training.max_global_steps averages its parameters with the others once more, waiting
    # up to this long for them (0: never): otherwise a trainer whose last rounds joined the others' previous step
    # ends one update apart from them. Give it more than the gap between trainers' last updates (up to a step)
    final_averaging_seconds: float = 10.0
    # how often a peer reads the swarm's progress (hivemind's progress tracker): every max seconds, down to every
    # min seconds as the global step's end nears. Each read asks every peer that holds the progress records, and
    # each answer carries every peer's signed record, so on a small swarm of short steps these reads are most of a
    # peer's traffic outside averaging rounds (paper_results/comparison/diloco)
    progress_poll_min_seconds: float = 0.2
    progress_poll_max_seconds: float = 1.0
    # a peer's progress record lives this long after its last report (hivemind's metadata_expiration), so the
    # swarm's step outlives crashed trainers by as much; a newcomer whose state downloads served nothing as new as
    # that step for as long concludes the peers that held the state left, and goes on from the newest one served
    progress_expiration: float = 60.0
    expected_peers: int = 1  # start barrier: trainers wait until this many trainers report progress
    start_barrier_timeout: float = 120.0
    # run reports call trainers' final parameters "the same" within this (max absolute element difference);
    # lossy wire compression leaves peers legitimately apart, by how much depends on the optimizer (see configs)
    agreement_tolerance: float = 1e-3
    # semantics=diloco: global steps (target batches of the swarm) between outer steps. With local_batch_size x
    # trainers = target_batch_size each global step is one inner optimizer step per trainer, DiLoCo's H; every
    # trainer of a run must use the same value (and outer settings), or it is refused when it joins
    inner_steps: int = 50
    outer_lr: float = 0.7  # the outer Nesterov SGD on the averaged pseudo-gradient (DiLoCo's defaults)
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        require(
            bool(self.run_id) and self.run_id.replace("_", "").replace("-", "").isalnum(),
            f"collaboration.run_id must be letters, digits, '-' or '_' (got {self.run_id!r})",
        )
        require(self.target_batch_size > 0, "collaboration.target_batch_size must be > 0")
        require(self.bandwidth is None or self.bandwidth > 0, "collaboration.bandwidth must be > 0")
        require(self.matchmaking_time > 0, "collaboration.matchmaking_time must be > 0")
        require(self.bandwidth_probe_seconds > 0, "collaboration.bandwidth_probe_seconds must be > 0")
        require(
            self.averaging_timeout > self.matchmaking_time,
            "collaboration.averaging_timeout must exceed collaboration.matchmaking_time",
        )
        require(
            self.next_chunk_timeout is None or 0 < self.next_chunk_timeout < self.averaging_timeout,
            "collaboration.next_chunk_timeout must be > 0 and below collaboration.averaging_timeout",
        )
        require(self.average_state_every >= 1, "collaboration.average_state_every must be >= 1")
        require(
            self.target_group_size is None or self.target_group_size > 1,
            f"collaboration.target_group_size must be > 1 or null (got {self.target_group_size})",
        )
        require(
            self.max_concurrent_state_uploads is None or self.max_concurrent_state_uploads >= 1,
            "collaboration.max_concurrent_state_uploads must be >= 1 or null "
            f"(got {self.max_concurrent_state_uploads})",
        )
        require(self.load_state_timeout > 0, "collaboration.load_state_timeout must be > 0")
        require(self.load_state_deadline > 0, "collaboration.load_state_deadline must be > 0")
        require(self.final_averaging_seconds >= 0, "collaboration.final_averaging_seconds must be >= 0")
        require(
            0 < self.progress_poll_min_seconds <= self.progress_poll_max_seconds,
            "collaboration.progress_poll_min_seconds must be > 0 and at most collaboration.progress_poll_max_seconds",
        )
        require(self.progress_expiration > 0, "collaboration.progress_expiration must be > 0")
        require(self.expected_peers >= 1, "collaboration.expected_peers must be >= 1")
        require(self.agreement_tolerance > 0, "collaboration.agreement_tolerance must be > 0")
        require(self.inner_steps >= 1, f"collaboration.inner_steps must be >= 1 (got {self.inner_steps})")
        require(self.outer_lr > 0, f"collaboration.outer_lr must be > 0 (got {self.outer_lr})")
        require(
            0 <= self.outer_momentum < 1, f"collaboration.outer_momentum must be in [0, 1) (got {self.outer_momentum})"
        )
        # hivemind imports bitsandbytes only when the first averaging round runs: without it every round would fail
        require(
            self.compression != Compression.blockwise8bit or importlib.util.find_spec("bitsandbytes") is not None,
            "collaboration.compression=blockwise8bit needs the bitsandbytes package, which is not installed here: "
            "install it (pip install bitsandbytes) or use uniform8bit or fp16",
        )


@dataclass
class TrainingConfig:
    backend: Backend = Backend.collaborative
    local_batch_size: int = 8  # samples per forward/backward on one peer
    max_global_steps: int = 100
    max_wall_seconds: Optional[float] = None
    seed: int = 0
    num_threads: int = 1  # torch intra-op threads per peer (peers share the machine's cores)
    device: str = "auto"  # auto | cpu | cuda
    # auto | fp32 | fp16 | bf16 (common/precision.py). auto = bf16 on GPUs that have it (float32's exponent range:
    # no loss scaling, no skipped steps), fp16 with dynamic loss scaling on older GPUs, fp32 on a CPU. fp16 on a
    # CPU is a config error (debug.fp16_on_cpu runs it anyway, for tests of the scaler)
    precision: str = "auto"
    log_every_seconds: float = 10.0
    output_dir: str = "outputs/run"
    skip_nonfinite: bool = True  # drop a micro-batch whose loss or gradients are not finite
    dataloader_workers: int = 0  # processes preparing batches (pinned memory on CUDA); 0 = on the training thread
    checkpoint_every_steps: int = 0  # single/ddp baselines: save every N global steps and resume on start; 0 = off
    keep_checkpoints: int = 3

    def __post_init__(self) -> None:
        require(self.local_batch_size > 0, "training.local_batch_size must be > 0")
        require(self.max_global_steps > 0, "training.max_global_steps must be > 0")
        require(self.max_wall_seconds is None or self.max_wall_seconds > 0, "training.max_wall_seconds must be > 0")
        require(self.num_threads >= 1, "training.num_threads must be >= 1")
        require(
            self.device in ("auto", "cpu", "cuda"), f"training.device must be auto, cpu or cuda (got {self.device!r})"
        )
        require(
            self.precision in ("auto", "fp32", "fp16", "bf16"),
            f"training.precision must be auto, fp32, fp16 or bf16 (got {self.precision!r})",
        )
        require(self.dataloader_workers >= 0, "training.dataloader_workers must be >= 0")
        require(self.checkpoint_every_steps >= 0, "training.checkpoint_every_steps must be >= 0")
        require(self.keep_checkpoints >= 1, "training.keep_checkpoints must be >= 1")
        require(self.log_every_seconds > 0, "training.log_every_seconds must be > 0")
        require_directory_path(self.output_dir, "training.output_dir")


@dataclass
class DebugConfig:
    """Switches for tests and investigations; a real run leaves them at their defaults."""

    record_sample_ids: bool = False  # log which samples went into each global step (equivalence checks)
    inject_nonfinite_every: int = 0  # fault injection: every N-th micro-batch's loss becomes NaN
    # fault injection: the first micro-batch of this global step gets an infinite gradient (an fp16 overflow)
    inject_overflow_at_step: int = -1
    fp16_on_cpu: bool = False  # allow training.precision=fp16 without a GPU (CPU autocast + loss scaler: tests)

    def __post_init__(self) -> None:
        require(self.inject_nonfinite_every >= 0, "debug.inject_nonfinite_every must be >= 0")
        require(self.inject_overflow_at_step >= -1, "debug.inject_overflow_at_step must be >= -1 (-1 = off)")


@dataclass
class MonitorConfig:
    refresh_seconds: float = 1.0
    checkpoint_every_steps: int = 0  # 0 disables checkpoints
    checkpoint_dir: Optional[str] = None  # default: <training.output_dir>/checkpoints
    keep_checkpoints: int = 3
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "dedloc"
    # seconds a peer's step records stay in the DHT (each peer republishes those of this span, at most
    # common.metrics.MAX_RECORDS_PUBLISHED steps): a monitor down for less than that recovers every step it missed
    metrics_expiration: float = 1800.0
    # the live page (common.dashboard): progress, peers, contributors and the join command, read-only; it listens
    # on this machine only unless dashboard_host says otherwise (e.g. 0.0.0.0 to let volunteers open it)
    dashboard: bool = False
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8765  # 0: any free port (the monitor logs the URL and writes it to dashboard_url.txt)

    def __post_init__(self) -> None:
        require(self.refresh_seconds > 0, "monitor.refresh_seconds must be > 0")
        require(bool(self.dashboard_host.strip()), "monitor.dashboard_host must name an address (e.g. 127.0.0.1)")
        require(
            0 <= self.dashboard_port <= 65535,
            f"monitor.dashboard_port must be 0..65535 (got {self.dashboard_port})",
        )
        require(self.checkpoint_every_steps >= 0, "monitor.checkpoint_every_steps must be >= 0")
        require(self.keep_checkpoints >= 1, "monitor.keep_checkpoints must be >= 1")
        if self.checkpoint_dir is not None:
            require_directory_path(self.checkpoint_dir, "monitor.checkpoint_dir")
        require(
            self.wandb_mode in ("offline", "online", "disabled"),
            f"monitor.wandb_mode must be offline, online or disabled (got {self.wandb_mode!r})",
        )


@dataclass
class RunConfig:
    task_module: str = MISSING  # experiment package whose task.py defines TaskConfig and build_task
    task: Any = MISSING
    network: NetworkConfig = field(default_factory=NetworkConfig)
    collaboration: CollaborationConfig = field(default_factory=CollaborationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def import_task_module(name: str):
    """The experiment package's ``task`` module (``albert`` -> ``albert.task``)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"task_module must name an experiment package, a folder with a task.py (got {name!r})")
    try:
        module = importlib.import_module(f"{name}.task")
    except ModuleNotFoundError as error:
        if error.name in (name, f"{name}.task"):
            raise ConfigError(f"task_module {name!r} is not an experiment package (no {name}/task.py)") from None
        raise
    for attribute in ("TaskConfig", "build_task"):
        if not hasattr(module, attribute):
            raise ConfigError(f"experiment package {name!r} has no {attribute} in {name}/task.py")
    return module


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    message = text[0] if text else type(error).__name__
    full_key = getattr(error, "full_key", None)
    if full_key and full_key not in message:
        message = f"{full_key}: {message}"
    return message


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load ``path`` (YAML), apply ``key=value`` overrides, validate, and return typed dataclasses."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = OmegaConf.load(path)
    except Exception as error:  # yaml errors come in many types
        raise ConfigError(f"cannot parse config file {path}: {_one_line(error)}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of sections (task_module:, task:, ...), not a list")
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} is not of the form key=value")
    try:
        merged_raw = OmegaConf.merge(raw, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as error:
        raise ConfigError(f"bad override: {_one_line(error)}") from None
    return config_from_container(merged_raw, source=str(path))


def config_from_container(raw: Any, source: str = "config") -> RunConfig:
    """Validate a plain dict / DictConfig against the schema (``task`` against its experiment's schema)."""
    raw = OmegaConf.create(raw) if not OmegaConf.is_config(raw) else raw
    task_module = raw.get("task_module")
    if task_module is None:
        raise ConfigError(f"{source}: missing required key task_module")
    module = import_task_module(task_module)
    schema = OmegaConf.structured(RunConfig)
    schema.task = OmegaConf.structured(module.TaskConfig)
    try:
        merged = OmegaConf.merge(schema, raw)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{source}: {_one_line(error)}") from None
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
    if not isinstance(config.task, module.TaskConfig):  # to_object leaves an Any field untyped on some paths
        try:
            config.task = module.TaskConfig(**OmegaConf.to_container(merged.task))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{source}: task: {error}") from None
    require_semantics_the_backend_has(config, source)
    return config


# One process can hold a gradient back a step (dpu's staleness without a swarm); DDP steps as `sync` only, and
# local updates (local, diloco) only mean something between peers.
BACKEND_SEMANTICS = {
    Backend.collaborative: tuple(Semantics),
    Backend.single: (Semantics.sync, Semantics.dpu),
    Backend.ddp: (Semantics.sync,),
}


def require_semantics_the_backend_has(config: RunConfig, source: str) -> None:
    allowed = BACKEND_SEMANTICS[config.training.backend]
    if config.collaboration.semantics not in allowed:
        raise ConfigError(
            f"{source}: training.backend={config.training.backend.value} supports collaboration.semantics "
            f"{' or '.join(semantics.value for semantics in allowed)}, not {config.collaboration.semantics.value}"
        )


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_container(config: RunConfig) -> dict:
    """The resolved config as plain nested dicts (enums as their values), e.g. for wandb's run config."""
    return OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)
