"""A trainer one step behind the swarm right after its update: hivemind reloads the swarm's state; with
``collaboration.catch_up_one_step_behind`` it steps to catch up, and two steps behind still reloads."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import hivemind
import pytest

from common.config import CollaborationConfig
from common.hivemind_compat import catch_up_one_step_behind
from common.optimizer import make_collaborative_optimizer
from tests.helpers import OneWeightTask
from tests.leftovers import leaves_nothing_behind  # noqa: F401 (the fixture, for usefixtures)


def swarm_progress(global_epoch: int) -> SimpleNamespace:
    """The progress tracker's view once the swarm's progress for this epoch is in."""
    fetched = threading.Event()
    fetched.set()
    return SimpleNamespace(global_epoch=global_epoch, fetched_global_progress_this_epoch=fetched)


def trainer_after_update(local_epoch: int, global_epoch: int) -> SimpleNamespace:
    """The state ``hivemind.Optimizer.step`` checks: an update has just happened and the swarm's progress is in."""
    return SimpleNamespace(
        local_epoch=local_epoch, tracker=swarm_progress(global_epoch), _should_check_synchronization_on_update=True
    )


def hivemind_reloads(trainer: SimpleNamespace) -> bool:
    return hivemind.Optimizer._should_load_state_from_peers(trainer)


def patched_reloads(trainer: SimpleNamespace) -> bool:
    catch_up_one_step_behind(trainer)
    return trainer._should_load_state_from_peers()


@pytest.mark.parametrize(
    "behind, hivemind_reload, patched_reload",
    [(0, False, False), (1, True, False), (2, True, True), (5, True, True)],
)
def test_only_two_or_more_steps_behind_reloads(behind, hivemind_reload, patched_reload):
    assert hivemind_reloads(trainer_after_update(10, 10 + behind)) is hivemind_reload
    trainer = trainer_after_update(10, 10 + behind)
    assert patched_reloads(trainer) is patched_reload
    assert trainer._should_check_synchronization_on_update is False  # the check is spent, as in hivemind


def test_check_waits_for_the_swarms_progress():
    """Before the swarm's progress for this epoch is fetched, the once-per-step check stays pending."""
    trainer = trainer_after_update(10, 11)
    trainer.tracker.fetched_global_progress_this_epoch.clear()
    assert patched_reloads(trainer) is False
    assert trainer._should_check_synchronization_on_update is True


def test_off_by_default():
    assert CollaborationConfig().catch_up_one_step_behind is False


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("catch_up", [False, True])
def test_the_setting_reaches_the_optimizer(catch_up):
    """A hivemind.Optimizer built from the config, one step behind the swarm right after an update."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        collab = CollaborationConfig(run_id="catch_up_test", catch_up_one_step_behind=catch_up)
        optimizer = make_collaborative_optimizer(dht, OneWeightTask(), collab, local_batch_size=4)
        try:
            # the swarm's progress as the tracker would report it, without waiting on the tracker's fetches
            tracker, optimizer.tracker = optimizer.tracker, swarm_progress(optimizer.local_epoch + 1)
            try:
                optimizer._should_check_synchronization_on_update = True  # as right after an update
                assert optimizer._should_load_state_from_peers() is not catch_up
            finally:
                optimizer.tracker = tracker
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()
