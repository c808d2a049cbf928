"""Monitor role: the swarm's first peer. Aggregates trainers' metrics per global step, keeps the history
(JSONL/CSV, wandb offline), and checkpoints the collaboration state it downloads from peers. On restart it
resumes its history; from a checkpoint it serves the saved state, so a new swarm continues from there."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.auth import AuthorizerBase

from common.auth import averaging_run_id
from common.checkpoints import load_latest_checkpoint, save_checkpoint
from common.config import RunConfig, import_task_module, to_container
from common.dashboard import start_dashboard
from common.dht import visible_multiaddrs
from common.errors import PeerError
from common.export import facts_at_step
from common.identity import peer_id_of_record_owner
from common.lifecycle import StopFlag
from common.metrics import HistoryWriter, PeerMetrics, StepAggregate, StepAggregator, metrics_key
from common.optimizer import load_outer_checkpoint_state, make_checkpoint_state_averager, outer_checkpoint_state
from common.peer import read_entry_peers, read_join_command, start_peer_dht, write_join_command
from common.task import EXPORT_DIR

logger = logging.getLogger(__name__)
CHECKPOINT_RETRY_MAX_SECONDS = 16.0
FINAL_POLL_SECONDS = 5.0  # the last look for records while stopping
DHT_ALIVE_CHECK_SECONDS = 1.0  # how often a wait for the DHT's answer checks that its process still runs
ENTRY_PEERS_REFRESH_SECONDS = 30.0  # how often the join command is brought up to date with the live entry peers
# how long checkpoint downloads fail before the monitor looks for a cause it can name: longer than a trainer takes to
# declare its state after it starts, shorter than the minutes an operator would otherwise spend reading logs
STATE_SERVERS_WARNING_SECONDS = 120.0


class MetricsLogger:
    """wandb (offline by default) beside the JSONL/CSV history."""

    def __init__(self, config: RunConfig, output_dir: Path):
        self.run = None
        if config.monitor.wandb_mode == "disabled":
            return
        import wandb

        self.run = wandb.init(
            project=config.monitor.wandb_project,
            name=config.collaboration.run_id,
            mode=config.monitor.wandb_mode,
            dir=str(output_dir),
            resume="allow",
            id=config.collaboration.run_id,
            config=to_container(config),  # the resolved run config, as volunteers and readers see it
        )

    def log(self, aggregate: StepAggregate) -> None:
        if self.run is not None:
            rate = {} if aggregate.samples_per_second is None else {"samples_per_second": aggregate.samples_per_second}
            self.run.log(
                {
                    "loss": aggregate.loss,
                    "peers": aggregate.peers,
                    "samples": aggregate.samples,
                    **rate,
                    **aggregate.metrics,
                },
                step=aggregate.step,
            )

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


class Leaderboard:
    """Per contributor (peer id; ``peer`` shows its name): samples, global steps participated in, and time online
    (first to last step seen), like sahajBERT's model card. Rebuilt from the history on restart, so it survives
    the monitor. Two volunteers with the same name are two rows."""

    def __init__(self, path: Path, history: list):
        self.path, self.rows = path, {}
        for entry in history:
            self.add(entry)

    def add(self, entry: dict) -> None:
        for peer_id, samples in entry["contributions"].items():
            name = entry.get("names", {}).get(peer_id, peer_id)
            row = self.rows.setdefault(
                peer_id,
                {"peer": name, "peer_id": peer_id, "samples": 0, "steps": 0, "first_seen": entry["time"]},
            )
            row["peer"] = name  # a restarted volunteer may have renamed itself: show its latest name
            row["samples"] += samples
            row["steps"] += 1
            row["last_seen"] = entry["time"]
            utilisation = entry.get("utilisation", {}).get(peer_id)
            if utilisation is not None:  # as of its newest step (a restarted process starts its totals afresh)
                row["used_share"], row["compute_share"] = utilisation["used_share"], utilisation["compute_share"]

    def write(self) -> None:
        ranked = sorted(self.rows.values(), key=lambda row: -row["samples"])
        for row in ranked:
            row["hours_online"] = (row["last_seen"] - row["first_seen"]) / 3600
        self.path.write_text(json.dumps(ranked, indent=2))


class Monitor:
    def __init__(
        self, config: RunConfig, config_path: str, stop: StopFlag, authorizer: Optional[AuthorizerBase] = None
    ):
        self.config, self.stop = config, stop
        self.output_dir = Path(config.training.output_dir)
        self.checkpoint_dir = Path(config.monitor.checkpoint_dir or self.output_dir / "checkpoints")
        self.history = HistoryWriter(self.output_dir)
        self.aggregator = StepAggregator()
        resumed = self.history.read()
        if resumed:
            self.aggregator.finished_up_to = resumed[-1]["step"]
            self.aggregator.last_step_time = resumed[-1]["time"]
            logger.info(f"resuming history: {len(resumed)} steps already recorded (last step {resumed[-1]['step']})")
        self.leaderboard = Leaderboard(self.output_dir / "leaderboard.json", resumed)
        rows = self.leaderboard.rows.values()
        self.dashboard = start_dashboard(config, self.output_dir, resumed, self.checkpoint_dir, rows)
        self.config_path, self.authorizer = config_path, authorizer
        self.dht = start_peer_dht(config, self.output_dir, "scripts/train.py", config_path, authorizer, stop)
        self.entry_addresses: list = []  # other entry peers' addresses the join command lists
        self.next_entry_refresh = time.monotonic() + ENTRY_PEERS_REFRESH_SECONDS
        if self.dashboard is not None:
            self.dashboard.state.join_command = read_join_command(self.output_dir)
            self.dashboard.publish(self.leaderboard.rows.values())
        task_module = import_task_module(config.task_module)
        torch.manual_seed(config.training.seed)
        self.task = task_module.build_task(config, with_data=False)
        self.state_averager: Optional[TrainingStateAverager] = None
        self.last_checkpoint_step = -1
        self.checkpoint_failures, self.next_checkpoint_attempt = 0, 0.0  # bounded retries with backoff
        self.failing_since: Optional[float] = None  # when the current run of failed checkpoint downloads began
        self.warned_no_state_servers = False
        if config.monitor.checkpoint_every_steps > 0:
            self.state_averager = make_checkpoint_state_averager(
                self.dht,
                self.task,
                config.collaboration,
                # the trainers' state averagers' prefix (with a moderated run's secret tag): they serve its state
                prefix=f"{averaging_run_id(config.collaboration.run_id, authorizer)}_state_averager",
            )
            self._restore_checkpoint()
        self.metrics = MetricsLogger(config, self.output_dir)

    def _restore_checkpoint(self) -> None:
        state = load_latest_checkpoint(self.checkpoint_dir)
        if state is None:
            return
        self.task.model.load_state_dict(state["model"])
        self.state_averager.optimizer.load_state_dict(state["optimizer"])
        if self.state_averager.scheduler is not None and state.get("scheduler") is not None:
            self.state_averager.scheduler.load_state_dict(state["scheduler"])
        load_outer_checkpoint_state(self.state_averager, state)  # diloco: the outer optimizer's momentum
        self.state_averager.local_epoch = state["step"]
        self.state_averager.state_sharing_priority = state["step"]
        self.last_checkpoint_step = state["step"]
        # joining peers take the state of the highest priority (its global step) offered: trainers further on win
        logger.info(
            f"loaded the checkpoint of global step {state['step']}: joining trainers get it only while no peer "
            f"offers a newer state, and the swarm's newer state replaces it at the next checkpoint"
        )

    def poll(self, timeout: Optional[float] = None) -> bool:
        """Read every peer's recent step records (``timeout``: give up after that many seconds); False if the
        DHT process has ended.

        SIGTERM to the monitor's whole process group (a service manager, ``kill -- -PGID``) also reaches its
        hivemind children: the DHT and averager processes end at once (``StopFlag`` lets forked children die of
        SIGTERM) and p2pd with them. A request to a DHT process that has ended is never answered, so the wait
        checks that the process still runs.
        """
        request = self.dht.get(metrics_key(self.config.collaboration.run_id), latest=True, return_future=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                entry = request.result(timeout=DHT_ALIVE_CHECK_SECONDS)
                break
            except TimeoutError:
                if not self.dht.is_alive():
                    return False
                if deadline is not None and time.monotonic() > deadline:
                    logger.warning(f"the DHT did not answer within {timeout:.0f} s: the last records are not read")
                    return True
        if entry is not None and isinstance(entry.value, dict):
            for subkey, subkey_entry in entry.value.items():
                peer_id = peer_id_of_record_owner(subkey)  # the signing key, not a field its author could forge
                try:
                    peer = PeerMetrics.parse_obj(subkey_entry.value)
                except Exception:  # the schema validator already refuses these; never trust a record blindly
                    continue
                if peer.role != "trainer" or peer_id is None:
                    continue
                if self.dashboard is not None and peer.recent:
                    self.dashboard.saw_peer(peer_id, peer.peer_name, max(record.time for record in peer.recent))
                for record in peer.recent:
                    self.aggregator.add(peer_id, peer.peer_name, record)
        return True

    def publish_ready(self, flush: bool = False) -> None:
        ready = self.aggregator.pop_ready(flush=flush)
        for aggregate in ready:
            self.history.write(aggregate)
            self.leaderboard.add(aggregate.to_json())
            self.metrics.log(aggregate)
            accuracy = "".join(
                f" | {name} {value:.3f}" for name, value in aggregate.metrics.items() if name.endswith("accuracy")
            )
            rate = "" if aggregate.samples_per_second is None else f" | {aggregate.samples_per_second:.1f} samples/s"
            used = "" if aggregate.used_share is None else f" | {aggregate.used_share:.0%} of computed samples used"
            logger.info(
                f"global step {aggregate.step}: loss {aggregate.loss:.4f} | {aggregate.peers} peers | "
                f"{aggregate.samples} samples{rate}{accuracy}{used}"
            )
        if ready:
            self.leaderboard.write()
        if self.dashboard is not None:
            for aggregate in ready:
                self.dashboard.state.add_step(aggregate.to_json())
            self.dashboard.publish(self.leaderboard.rows.values())

    def maybe_checkpoint(self) -> None:
        every = self.config.monitor.checkpoint_every_steps
        if self.state_averager is None or self.aggregator.max_seen_step < self.last_checkpoint_step + every:
            return
        if time.monotonic() < self.next_checkpoint_attempt:
            return
        # one attempt asks every peer that declared state, newest first (hivemind); a failed attempt is retried
        # after 1, 2, 4 ... s (at most CHECKPOINT_RETRY_MAX_SECONDS), not at every poll
        failure = ""
        try:
            self.state_averager.load_state_from_peers(timeout=self.config.collaboration.load_state_timeout)
        except Exception as error:  # the download outlasted load_state_timeout (TimeoutError), ...: a failed attempt
            failure = f": {type(error).__name__} {error}".rstrip()
        step = self.state_averager.local_epoch
        if step <= self.last_checkpoint_step:
            self.checkpoint_failures += 1
            delay = min(CHECKPOINT_RETRY_MAX_SECONDS, 2.0 ** (self.checkpoint_failures - 1))
            self.next_checkpoint_attempt = time.monotonic() + delay
            logger.warning(
                f"no peer served a state newer than global step {self.last_checkpoint_step} for a checkpoint "
                f"(attempt {self.checkpoint_failures}{failure}); retrying in {delay:.0f} s"
            )
            self.failing_since = self.failing_since if self.failing_since is not None else time.monotonic()
            self.maybe_warn_no_state_servers()
            return
        self.checkpoint_failures, self.failing_since = 0, None
        if not all(bool(torch.isfinite(param).all()) for param in self.task.model.parameters()):
            logger.error(f"the swarm's state at global step {step} is not finite: not checkpointing it")
            self.last_checkpoint_step = step
            return
        scheduler = self.state_averager.scheduler
        state = {
            "step": step,
            "model": self.task.model.state_dict(),
            "optimizer": self.state_averager.optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "run_id": self.config.collaboration.run_id,
            **outer_checkpoint_state(self.state_averager),
        }
        path = save_checkpoint(self.checkpoint_dir, step, state, self.config.monitor.keep_checkpoints)
        self.state_averager.state_sharing_priority = step
        self.last_checkpoint_step = step
        logger.info(f"saved checkpoint {path} at global step {step}")
        if self.dashboard is not None:
            self.dashboard.checkpoint_saved(step, path)
        self.export(step)

    def state_servers(self) -> int:
        """How many other peers offer their state for download now, read from the key hivemind's averagers
        declare it under (a peer that does not share its state declares None)."""
        declared, _ = self.dht.get(f"{self.state_averager.prefix}.all_averagers", latest=True) or ({}, None)
        own = self.dht.peer_id.to_bytes()
        return sum(
            1
            for peer, entry in declared.items()
            if peer != own and isinstance(getattr(entry, "value", None), (int, float))
        )

    def maybe_warn_no_state_servers(self) -> None:
        """One warning naming the cause when the downloads have failed for STATE_SERVERS_WARNING_SECONDS because no
        peer offers a state: hivemind shares a state only from a non-auxiliary peer that accepts connections, so a
        swarm whose trainers all run in client mode never serves one (found by the sahajBERT rehearsal), and
        the per-attempt warnings alone do not say so."""
        if self.warned_no_state_servers or self.failing_since is None:
            return
        if time.monotonic() - self.failing_since < STATE_SERVERS_WARNING_SECONDS or self.state_servers() > 0:
            return
        self.warned_no_state_servers = True
        held = "none" if self.last_checkpoint_step < 0 else f"global step {self.last_checkpoint_step}"
        logger.warning(
            f"no peer has offered the training state for {time.monotonic() - self.failing_since:.0f} s while the "
            f"swarm reached global step {self.aggregator.max_seen_step}: hivemind serves the state only from "
            f"trainers that accept connections, so with every trainer in network.client_mode=true newcomers get "
            f"no state newer than this monitor's checkpoint ({held}) and no newer checkpoint is written; start at "
            f"least one trainer with a reachable address and network.client_mode=false"
        )

    def maybe_refresh_join_command(self) -> None:
        """List the live auxiliary peers' addresses in the join command beside ours: a volunteer joins through any
        of them, so the command outlives a monitor that is down."""
        if self.config.network.client_mode or time.monotonic() < self.next_entry_refresh:
            return
        self.next_entry_refresh = time.monotonic() + ENTRY_PEERS_REFRESH_SECONDS
        entries = read_entry_peers(self.dht, self.config.collaboration.run_id)
        if entries == self.entry_addresses:
            return
        self.entry_addresses = entries
        lines = write_join_command(
            self.output_dir,
            self.config,
            self.config_path,
            "scripts/train.py",
            visible_multiaddrs(self.dht),
            self.authorizer,
            entries,
        )
        if lines is not None and self.dashboard is not None:
            self.dashboard.state.join_command = read_join_command(self.output_dir)

    def export(self, step: int) -> None:
        """The checkpointed weights in the task's ecosystem format (a Hugging Face folder for ALBERT), rewritten
        at every checkpoint; the card states that step's facts from the history and every contributor up to it. A
        failing export is one ERROR line: the monitor keeps running."""
        facts = facts_at_step(
            self.history.read(),
            step,
            run_id=self.config.collaboration.run_id,
            exported_by=f"the monitor on its checkpoint of global step {step}",
            backend=self.config.training.backend.value,
            samples_per_step=self.config.collaboration.target_batch_size,
        )
        try:
            self.task.export_pretrained(self.task.model, self.output_dir / EXPORT_DIR, facts)
        except Exception as error:  # a task's own export code: whatever it raises must not end the run
            logger.error(f"could not export the checkpoint of global step {step}: {type(error).__name__}: {error}")

    def run(self) -> None:
        logger.info("monitor running: aggregating metrics per global step")
        try:
            while not self.stop.wait(self.config.monitor.refresh_seconds):
                if not self.poll():
                    if self.stop.is_set():
                        break  # stopping: the signal reached the DHT process too
                    raise PeerError("the monitor's DHT process ended unexpectedly: restart the monitor")
                self.publish_ready()
                self.maybe_checkpoint()
                self.maybe_refresh_join_command()
        finally:
            if not self.poll(timeout=FINAL_POLL_SECONDS):
                logger.info("the DHT process has already ended (the stop signal reached the whole process group)")
            self.publish_ready(flush=True)
            self.shutdown()

    def shutdown(self) -> None:
        if self.dashboard is not None:
            self.dashboard.stop()
        self.metrics.finish()
        # hivemind logs an ERROR when asked to shut down an averager process that already ended (a group SIGTERM);
        # the DHT's own shutdown checks that first
        if self.state_averager is not None and self.state_averager.is_alive():
            self.state_averager.shutdown()
        self.dht.shutdown()


def run_monitor(
    config: RunConfig, config_path: str, stop: StopFlag, authorizer: Optional[AuthorizerBase] = None
) -> None:
    torch.set_num_threads(config.training.num_threads)
    Monitor(config, config_path, stop, authorizer).run()
