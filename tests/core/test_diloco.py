"""semantics=diloco: its settings are validated on load, the outer step is DiLoCo's update, mismatched peers are
refused with one line, and the outer optimizer's state survives a state download and a checkpoint."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import hivemind
import pytest
import torch

from common.backends import (
    CollaborativeBackend,
    RunFingerprints,
    averaging_key,
    averaging_settings,
    publish_averaging_settings,
    require_same_averaging,
)
from common.config import CollaborationConfig, Semantics, load_config
from common.errors import ConfigError, PeerError
from common.hivemind_compat import install as install_hivemind_patches
from common.optimizer import (
    PARTIAL_ROUND,
    DiLoCoOptimizer,
    DiLoCoStateAverager,
    OuterAverager,
    load_outer_checkpoint_state,
    make_collaborative_optimizer,
    make_outer_optimizer,
    missed_an_outer_step,
    next_outer_lineage,
    outer_checkpoint_state,
    outer_momentum_tensors,
)
from tests.helpers import TINY_ALBERT, OneWeightTask
from tests.leftovers import leaves_nothing_behind  # noqa: F401 (the fixture, for usefixtures)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("collaboration.inner_steps=0", "collaboration.inner_steps must be >= 1"),
        ("collaboration.outer_lr=0", "collaboration.outer_lr must be > 0"),
        ("collaboration.outer_momentum=1.0", "collaboration.outer_momentum must be in [0, 1)"),
        ("collaboration.outer_momentum=-0.1", "collaboration.outer_momentum must be in [0, 1)"),
    ],
)
def test_bad_diloco_settings_are_one_line_config_errors(override, fragment):
    with pytest.raises(ConfigError) as error:
        load_config(TINY_ALBERT, ["collaboration.semantics=diloco", override])
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_diloco_defaults_are_dilocos_and_only_a_swarm_runs_it():
    config = load_config(TINY_ALBERT, ["collaboration.semantics=diloco"])
    assert config.collaboration.semantics == Semantics.diloco
    assert (config.collaboration.outer_lr, config.collaboration.outer_momentum) == (0.7, 0.9)
    for backend in ("single", "ddp"):
        with pytest.raises(ConfigError, match="supports collaboration.semantics"):
            load_config(TINY_ALBERT, ["collaboration.semantics=diloco", f"training.backend={backend}"])


def test_outer_optimizer_is_nesterov_sgd_with_its_momentum_ready():
    outer = [torch.tensor([1.0, 2.0])]
    optimizer = make_outer_optimizer(outer, lr=0.7, momentum=0.9)
    assert torch.equal(outer[0], torch.tensor([1.0, 2.0]))  # creating the momentum moved nothing
    (momentum,) = outer_momentum_tensors(optimizer)
    assert torch.equal(momentum, torch.zeros(2))
    for expected_momentum in ([0.5, -1.0], [0.95, -1.9]):  # two outer steps on the same pseudo-gradient
        before = outer[0].clone()
        outer[0].grad = torch.tensor([0.5, -1.0])
        optimizer.step()
        buffer = torch.tensor(expected_momentum)
        nesterov = outer[0].grad + 0.9 * buffer
        assert torch.allclose(outer_momentum_tensors(optimizer)[0], buffer)
        assert torch.allclose(outer[0], before - 0.7 * nesterov)
    assert outer_momentum_tensors(make_outer_optimizer([torch.zeros(1)], lr=1.0, momentum=0.0)) == []


def lone_trainer(params, outer, outer_optimizer):
    """What ``DiLoCoOptimizer._outer_step`` reads of a trainer that is alone in the swarm."""
    return SimpleNamespace(
        auxiliary=False,
        param_groups=[{"params": params}],
        outer_parameters=outer,
        outer_optimizer=outer_optimizer,
        tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=1)),
        state_averager=SimpleNamespace(lock_averaged_tensors=contextlib.nullcontext(), outer_lineage=""),
        dht=SimpleNamespace(peer_id="me"),
        status_loglevel=20,
        outer_steps=0,
    )


class FakeOuterAverager:
    """An outer averager whose rounds return fixed results: ``rounds`` holds, per call to ``step``, the gathered
    lineages and the averaged tensors the round leaves."""

    def __init__(self, tensors, rounds):
        self.tensors, self.rounds, self.calls, self.group_bits = tensors, list(rounds), [], ""

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.tensors

    def step(self, weight, gather, timeout):
        self.calls.append((self.group_bits, gather, [tensor.clone() for tensor in self.tensors]))
        gathered, averaged = self.rounds.pop(0)
        for tensor, value in zip(self.tensors, averaged):
            tensor.copy_(value)
        return None if gathered is None else dict(gathered)

    def set_group_bits(self, bits):
        self.group_bits = bits


def two_peer_trainer(model, outer, rounds):
    trainer = lone_trainer(model, outer, make_outer_optimizer(outer, lr=0.5, momentum=0.9))
    trainer.tracker.global_progress.num_peers = 2
    trainer.outer_averager = FakeOuterAverager([torch.zeros_like(outer[0])], rounds)
    trainer.averaging_timeout = 30.0
    trainer._realign_outer_state = lambda epoch: DiLoCoOptimizer._realign_outer_state(trainer, epoch)
    trainer._average_in_a_realigning_round = lambda state: DiLoCoOptimizer._average_in_a_realigning_round(
        trainer, state
    )
    trainer._outer_round = lambda values, what: DiLoCoOptimizer._outer_round(trainer, values, what)
    return trainer


@pytest.mark.parametrize(
    "local_epoch, global_epoch, download",
    [
        (7, 8, False),  # one step behind at an outer step: it takes its update and joins the round
        (9, 12, False),  # behind within one outer period (8-15): its own inner steps go on
        (0, 7, False),  # a newcomer before the first outer step: the seeded parameters are the outer ones
        (6, 8, True),  # two behind across an outer step: that round is over, the outer state moved on
        (0, 9, True),  # a newcomer after an outer step
        (12, 11, False),  # ahead of a stale global step
    ],
)
def test_a_diloco_trainer_downloads_the_state_only_when_it_missed_an_outer_step(local_epoch, global_epoch, download):
    assert missed_an_outer_step(local_epoch, global_epoch, inner_steps=8) is download
    trainer = SimpleNamespace(
        inner_steps=8,
        local_epoch=local_epoch,
        tracker=SimpleNamespace(global_epoch=global_epoch),
        _should_check_synchronization_on_update=True,  # right after an update: hivemind's exact check
    )
    assert DiLoCoOptimizer._should_load_state_from_peers(trainer) is download


def test_lineages_agree_for_the_members_of_one_round_and_differ_otherwise():
    together = next_outer_lineage(["a", "a"], 4, ["peer2", "peer1"])
    assert together == next_outer_lineage(["a"], 4, ["peer1", "peer2"])  # every member computes the same
    assert together != next_outer_lineage(["a"], 4, ["peer1"])  # one that stepped alone
    assert together != next_outer_lineage(["a"], 6, ["peer1", "peer2"])  # another global step
    assert together != next_outer_lineage(["a", "b"], 4, ["peer1", "peer2"])  # another history


def test_a_round_of_one_lineage_takes_the_outer_step_only():
    model, outer = [torch.nn.Parameter(torch.tensor([3.0]))], [torch.tensor([2.0])]
    trainer = two_peer_trainer(model, outer, [({"me": "", "other": ""}, [torch.tensor([-1.5])])])
    DiLoCoOptimizer._outer_step(trainer, next_epoch=2)
    assert len(trainer.outer_averager.calls) == 1  # no realigning round
    assert torch.allclose(outer[0], torch.tensor([2.0 - 0.5 * 1.9 * -1.5])) and torch.equal(model[0].data, outer[0])
    assert trainer.state_averager.outer_lineage == next_outer_lineage([""], 2, ["me", "other"])
    assert trainer.outer_state_agreed  # a run that ends here needs no final parameter round


def test_peers_with_different_lineages_average_their_outer_state_in_rounds_of_their_own():
    """A peer that stepped alone before meets the swarm again: after the pseudo-gradient round it averages its
    outer parameters and then its momentum with the round's other members, under the realigning group bits."""
    model, outer = [torch.nn.Parameter(torch.tensor([3.0]))], [torch.tensor([2.0])]
    pseudo_gradient_round = ({"me": "alone", "other": "swarm", "aux": None}, [torch.tensor([-1.0])])
    after_step = next_outer_lineage(["alone", "swarm"], 4, ["me", "other"])  # both members compute it
    parameter_round = ({"me": after_step, "other": after_step}, [torch.tensor([10.0])])
    momentum_round = ({"me": after_step, "other": after_step}, [torch.tensor([0.25])])
    trainer = two_peer_trainer(model, outer, [pseudo_gradient_round, parameter_round, momentum_round])
    DiLoCoOptimizer._outer_step(trainer, next_epoch=4)
    calls = trainer.outer_averager.calls
    assert [bits for bits, _, _ in calls] == ["", "1", "1"] and trainer.outer_averager.group_bits == ""
    stepped = 2.0 - 0.5 * 1.9 * -1.0  # the outer step on the averaged pseudo-gradient, then its state is averaged
    assert torch.allclose(calls[1][2][0], torch.tensor([stepped]))  # the parameter round sends the outer parameters
    assert torch.allclose(calls[2][2][0], torch.tensor([-1.0]))  # the momentum round sends the momentum
    assert torch.equal(outer[0], torch.tensor([10.0])) and torch.equal(model[0].data, torch.tensor([10.0]))
    assert torch.equal(outer_momentum_tensors(trainer.outer_optimizer)[0], torch.tensor([0.25]))
    assert calls[1][1] == after_step  # what the realigning rounds gather
    assert trainer.state_averager.outer_lineage == next_outer_lineage([after_step], 4, ["me", "other"], "realigned")
    assert trainer.outer_state_agreed


def test_a_realigning_round_without_partners_leaves_the_state_for_the_next_outer_step():
    model, outer = [torch.nn.Parameter(torch.tensor([3.0]))], [torch.tensor([2.0])]
    rounds = [({"me": "alone", "other": "swarm"}, [torch.tensor([-1.0])]), (None, [torch.tensor([99.0])])]
    trainer = two_peer_trainer(model, outer, rounds)
    DiLoCoOptimizer._outer_step(trainer, next_epoch=4)
    assert torch.allclose(outer[0], torch.tensor([2.0 + 0.95])) and trainer.outer_averager.group_bits == ""
    assert torch.equal(model[0].data, outer[0])
    after_step = next_outer_lineage(["alone", "swarm"], 4, ["me", "other"])
    assert trainer.state_averager.outer_lineage not in ("", after_step)  # the next round finds the difference again
    assert not trainer.outer_state_agreed


def test_outer_step_applies_the_pseudo_gradient_and_resets_the_model_to_the_outer_parameters():
    model = [torch.nn.Parameter(torch.tensor([3.0, -1.0]))]
    outer = [torch.tensor([2.0, 1.0])]  # where the last outer step left the swarm
    trainer = lone_trainer(model, outer, make_outer_optimizer(outer, lr=0.7, momentum=0.9))
    DiLoCoOptimizer._outer_step(trainer, next_epoch=4)
    pseudo_gradient = torch.tensor([2.0, 1.0]) - torch.tensor([3.0, -1.0])  # outer minus local: (-1, 2)
    expected = torch.tensor([2.0, 1.0]) - 0.7 * (pseudo_gradient + 0.9 * pseudo_gradient)
    assert torch.allclose(outer[0], expected) and torch.equal(model[0].detach(), outer[0])
    assert outer[0].grad is None and trainer.outer_steps == 1


def test_outer_lr_one_without_momentum_is_parameter_averaging():
    """The `local` semantics' update as a special case: with outer lr 1 and no momentum an outer step moves the
    parameters to (here: one peer's) local parameters."""
    model = [torch.nn.Parameter(torch.tensor([3.0, -1.0]))]
    outer = [torch.tensor([2.0, 1.0])]
    DiLoCoOptimizer._outer_step(lone_trainer(model, outer, make_outer_optimizer(outer, 1.0, 0.0)), next_epoch=1)
    assert torch.allclose(outer[0], torch.tensor([3.0, -1.0]))


def test_the_settings_peers_must_share_are_named():
    assert averaging_settings(CollaborationConfig()) == "sync"
    settings = averaging_settings(CollaborationConfig(semantics=Semantics.diloco, inner_steps=20, outer_lr=0.5))
    assert settings == "diloco with inner_steps=20, outer_lr=0.5, outer_momentum=0.9"


@contextlib.contextmanager
def local_dht():
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        yield dht
    finally:
        dht.shutdown()


def fingerprints(**collab) -> RunFingerprints:
    return RunFingerprints("model", averaging=averaging_settings(CollaborationConfig(**collab)))


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.timeout(60)
def test_peers_with_other_diloco_settings_are_refused_with_one_line():
    with local_dht() as dht:
        run = dict(semantics=Semantics.diloco, inner_steps=50)
        publish_averaging_settings(dht, "run", "trainer0", averaging_settings(CollaborationConfig(**run)), 60).result()
        require_same_averaging(dht, "run", fingerprints(**run))  # the same settings join
        for other in (
            dict(run, inner_steps=10),
            dict(run, outer_lr=0.1),
            dict(run, outer_momentum=0.0),
            dict(semantics=Semantics.sync),
        ):
            with pytest.raises(PeerError) as error:
                require_same_averaging(dht, "run", fingerprints(**other))
            message = str(error.value)
            assert "\n" not in message and "trainer0 uses diloco with inner_steps=50" in message
        publish_averaging_settings(dht, "gradients", "trainer0", "sync", 60).result()
        require_same_averaging(dht, "gradients", fingerprints(semantics=Semantics.dpu))  # as before diloco
        with pytest.raises(PeerError, match="trainer0 uses sync, this peer diloco"):
            require_same_averaging(dht, "gradients", fingerprints(**run))


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.timeout(120)
def test_a_lone_trainer_takes_an_outer_step_every_inner_steps_global_steps():
    """A real DiLoCoOptimizer, alone: inner SGD (lr 1) on every micro-batch, an outer step every 2 global steps."""
    install_hivemind_patches()  # as every peer does before its averagers are forked
    with local_dht() as dht:
        task = OneWeightTask()
        collab = CollaborationConfig(
            run_id="diloco_lone", semantics=Semantics.diloco, inner_steps=2, target_batch_size=4, matchmaking_time=1
        )
        optimizer = make_collaborative_optimizer(dht, task, collab, local_batch_size=4)
        try:
            assert isinstance(optimizer, DiLoCoOptimizer) and optimizer.grad_averager is None
            weight = task.model.weight
            expected_outer, momentum = 0.0, 0.0
            for outer_round in range(2):
                for _ in range(2):  # two global steps of one micro-batch each: two inner steps of -1
                    epoch = optimizer.local_epoch
                    weight.grad = torch.ones_like(weight)
                    optimizer.step(batch_size=4)
                    wait_until(lambda: optimizer.local_epoch > epoch or _step_again(optimizer), 30, "a global step")
                pseudo_gradient = expected_outer - (expected_outer - 2.0)  # outer minus local after two inner steps
                momentum = 0.9 * momentum + pseudo_gradient
                expected_outer -= 0.7 * (pseudo_gradient + 0.9 * momentum)
                assert optimizer.outer_steps == outer_round + 1
                assert weight.item() == pytest.approx(expected_outer, abs=1e-5)
                assert optimizer.outer_parameters[0].item() == pytest.approx(expected_outer, abs=1e-5)
        finally:
            optimizer.shutdown()


def _step_again(optimizer) -> bool:
    """hivemind moves to the next global step on a ``step`` call once its tracker has seen the samples: call it
    with nothing new until then."""
    weight = optimizer.param_groups[0]["params"][0]
    weight.grad = torch.zeros_like(weight)
    optimizer.step(batch_size=0)
    return False


def make_state_holder(
    dht, prefix: str, value: float, momentum: float, epoch: int, trainer: bool = False
) -> DiLoCoStateAverager:
    """A DiLoCo state averager over one weight whose outer parameter and momentum are set to the given values;
    ``trainer``: its outer parameter is a copy apart from the model (else the model's own, as on the monitor)."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    outer = [param.detach().clone() for param in model.parameters()] if trainer else list(model.parameters())
    outer_optimizer = make_outer_optimizer(outer, lr=0.7, momentum=0.9)
    for buffer in outer_momentum_tensors(outer_optimizer):
        buffer.fill_(momentum)
    averager = DiLoCoStateAverager(
        outer_optimizer=outer_optimizer,
        dht=dht,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
        params=[{"params": list(model.parameters())}],
        prefix=prefix,
        start=True,
    )
    averager.local_epoch = epoch
    return averager


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.timeout(120)
def test_a_joiner_downloads_outer_parameters_and_momentum_and_a_checkpoint_keeps_them():
    install_hivemind_patches()  # as every peer does before its averagers are forked
    with local_dht() as first, contextlib.ExitStack() as stack:
        second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True)
        stack.callback(second.shutdown)
        donor = make_state_holder(first, "diloco_state", value=0.25, momentum=-3.0, epoch=6, trainer=True)
        stack.callback(donor.shutdown)
        donor.state_sharing_priority = 6
        # the donor's model has drifted from its outer parameter: the joiner must get the outer one
        with torch.no_grad():
            donor.optimizer.param_groups[0]["params"][0].fill_(9.0)
        joiner = make_state_holder(second, "diloco_state", value=0.0, momentum=0.0, epoch=0, trainer=True)
        stack.callback(joiner.shutdown)
        loaded = threading.Event()

        def download() -> None:
            while joiner.local_epoch != 6:
                joiner.load_state_from_peers(timeout=10)
            loaded.set()

        threading.Thread(target=download, daemon=True).start()
        assert loaded.wait(60), "the joiner never loaded the donor's state"
        joiner_weight = joiner.optimizer.param_groups[0]["params"][0]
        assert joiner_weight.item() == 0.25 and joiner.outer_parameters[0].item() == 0.25
        assert outer_momentum_tensors(joiner.outer_optimizer)[0].item() == -3.0

        state = outer_checkpoint_state(joiner)
        restored = make_state_holder(second, "diloco_restored", value=0.25, momentum=0.0, epoch=0)
        stack.callback(restored.shutdown)
        load_outer_checkpoint_state(restored, state)
        assert outer_momentum_tensors(restored.outer_optimizer)[0].item() == -3.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_auxiliary_peer_with_other_diloco_settings_is_refused_and_one_with_the_runs_announces_them(
    tmp_path, tiny_overrides
):
    """An auxiliary peer takes a share of every round, so it must form updates as the trainers do: one with another
    H is refused with one line, as a trainer would be; one with the run's settings announces them, so that a
    trainer with other settings is refused in turn."""
    from common.swarm import LocalSwarm
    from tests.helpers import assert_no_processes_left

    run = dict(semantics=Semantics.diloco, inner_steps=50)
    overrides = [*tiny_overrides, "collaboration.run_id=aux_check", "collaboration.semantics=diloco"]
    with local_dht() as dht, LocalSwarm(TINY_ALBERT, tmp_path, overrides) as swarm:
        settings = averaging_settings(CollaborationConfig(**run))
        publish_averaging_settings(dht, "aux_check", "trainer0", settings, 300).result()
        swarm.initial_peers = [str(address) for address in dht.get_visible_maddrs()]

        swarm.start("auxiliary", "aux_other", ["collaboration.inner_steps=10"])
        assert swarm.wait(["aux_other"], timeout=180), "the auxiliary peer with another H was not refused"
        other = swarm.peers["aux_other"]
        log = other.log_path.read_text(errors="replace")
        assert other.process.returncode == 2, other.log_tail(10)
        assert "forms its updates otherwise (peer trainer0 uses diloco with inner_steps=50" in log
        assert "this peer diloco with inner_steps=10" in log and "Traceback" not in log

        swarm.start("auxiliary", "aux_same", ["collaboration.inner_steps=50"])
        deadline = time.monotonic() + 180
        while not any(
            record.value == {"peer": "auxiliary", "settings": settings}
            for record in (getattr(dht.get(averaging_key("aux_check"), latest=True), "value", None) or {}).values()
        ):
            assert swarm.peers["aux_same"].alive(), swarm.peers["aux_same"].log_tail(10)
            assert time.monotonic() < deadline, "the auxiliary peer never announced its averaging settings"
            time.sleep(0.5)
        swarm.stop("aux_same")
        assert swarm.peers["aux_same"].process.returncode == 0, swarm.peers["aux_same"].log_tail(10)
    assert_no_processes_left(tmp_path)


def test_a_partial_round_gives_the_peer_a_lineage_of_its_own():
    """A member failed while reducing its part: the others kept their own values for that part, so the round's
    members now differ although they gathered one lineage; each takes a lineage of its own, so that the next round
    realigns them."""
    model, outer = [torch.nn.Parameter(torch.tensor([3.0]))], [torch.tensor([2.0])]
    partial_round = ({"me": "", "other": "", PARTIAL_ROUND: True}, [torch.tensor([-1.5])])
    trainer = two_peer_trainer(model, outer, [partial_round])
    DiLoCoOptimizer._outer_step(trainer, next_epoch=2)
    assert len(trainer.outer_averager.calls) == 1  # realigning waits for the next round, where the others are
    assert torch.allclose(outer[0], torch.tensor([2.0 - 0.5 * 1.9 * -1.5]))  # the step is taken as averaged
    whole = next_outer_lineage([""], 2, ["me", "other"])
    assert trainer.state_averager.outer_lineage == next_outer_lineage([whole], 2, ["me"], kind="partial round")
    assert not trainer.outer_state_agreed  # a run that ends here averages its final parameters once more


def test_a_partial_realigning_round_counts_as_no_round():
    model, outer = [torch.nn.Parameter(torch.tensor([3.0]))], [torch.tensor([2.0])]
    rounds = [
        ({"me": "alone", "other": "swarm"}, [torch.tensor([-1.0])]),
        ({"me": "L", "other": "L", PARTIAL_ROUND: True}, [torch.tensor([99.0])]),
    ]
    trainer = two_peer_trainer(model, outer, rounds)
    DiLoCoOptimizer._outer_step(trainer, next_epoch=4)
    assert torch.allclose(outer[0], torch.tensor([2.0 + 0.95])) and torch.equal(model[0].data, outer[0])
    after_step = next_outer_lineage(["alone", "swarm"], 4, ["me", "other"])
    assert trainer.state_averager.outer_lineage not in ("", after_step)


@pytest.mark.parametrize("failed_size, partial", [(0, False), (3, True)])
def test_the_outer_averager_marks_a_round_in_which_a_reducer_failed(monkeypatch, failed_size, partial):
    """hivemind's runner counts the values whose reducer failed (kept at this peer's own) in its part container's
    ``failed_size``; the outer averager reads it after the all-reduce and marks the round's gathered data."""
    import asyncio

    from hivemind.averaging.averager import DecentralizedAverager

    runner = SimpleNamespace(tensor_part_container=SimpleNamespace(failed_size=failed_size))

    async def run_allreduce(self, tensors, group_info, group_id=None, **kwargs):
        self._running_groups[group_info.group_id].set_result(runner)

    async def aggregate(self, group_info, min_vector_size, **kwargs):
        await self._run_allreduce_inplace_([], group_info)
        return {"peer_a": "lineage", "peer_b": "lineage"}

    monkeypatch.setattr(DecentralizedAverager, "_run_allreduce_inplace_", run_allreduce)
    monkeypatch.setattr(DecentralizedAverager, "_aggregate_with_group", aggregate)

    async def one_round():
        averager = OuterAverager.__new__(OuterAverager)  # only what a round's aggregation touches
        averager._parent_pid = -1  # never started: nothing for hivemind's __del__ to shut down
        averager._running_groups = {b"group": asyncio.get_running_loop().create_future()}
        return await averager._aggregate_with_group(SimpleNamespace(group_id=b"group"), min_vector_size=0)

    gathered = asyncio.run(one_round())
    assert gathered == (
        {"peer_a": "lineage", "peer_b": "lineage", PARTIAL_ROUND: True}
        if partial
        else {"peer_a": "lineage", "peer_b": "lineage"}
    )


class RecordingStateAverager:
    def __init__(self):
        self.rounds = 0

    def schedule_step(self, **kwargs):
        return SimpleNamespace(began_allreduce=True, cancel=lambda: None)

    def step(self, **kwargs):
        self.rounds += 1


@pytest.mark.parametrize("agreed, final_round", [(True, False), (False, True)])
def test_a_run_ending_on_an_outer_step_averages_its_final_parameters_only_if_that_round_was_partial(
    agreed, final_round
):
    """A member that left while it reduced its share (an auxiliary peer that exits at the last step) leaves every
    trainer its own values for that share: then the final parameter round pulls them together."""
    averager = RecordingStateAverager()
    backend = SimpleNamespace(
        collab=CollaborationConfig(semantics=Semantics.diloco, inner_steps=5, final_averaging_seconds=3.0),
        global_step=10,
        optimizer=SimpleNamespace(
            tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=2)),
            outer_state_agreed=agreed,
            state_averager=averager,
        ),
    )
    CollaborativeBackend.average_final_parameters(backend)
    assert averager.rounds == int(final_round)
