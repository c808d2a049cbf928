"""``collaboration.target_group_size`` and ``collaboration.max_concurrent_state_uploads``: validated on load, and
handed to hivemind's averagers (the group cap to every averager that matchmakes, the upload limit to every averager
that serves the state), where the patch ``limit_concurrent_state_uploads`` enforces the limit."""

import threading
import time

import hivemind
import pytest
import torch
from hivemind.averaging.averager import DecentralizedAverager

from common.config import CollaborationConfig, Semantics, load_config
from common.errors import ConfigError
from common.hivemind_patches.uploads import LIMIT_ATTRIBUTE
from common.optimizer import make_checkpoint_state_averager, make_collaborative_optimizer
from tests.helpers import OneWeightTask
from tests.leftovers import leaves_nothing_behind  # noqa: F401 (the fixture, for usefixtures)

CONFIG = "configs/albert/tiny.yaml"


def test_both_keys_default_to_hiveminds_behaviour_and_load_when_valid():
    assert CollaborationConfig().target_group_size is None
    assert CollaborationConfig().max_concurrent_state_uploads is None
    collab = load_config(
        CONFIG, ["collaboration.target_group_size=16", "collaboration.max_concurrent_state_uploads=1"]
    ).collaboration
    assert (collab.target_group_size, collab.max_concurrent_state_uploads) == (16, 1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("collaboration.target_group_size=1", "collaboration.target_group_size must be > 1 or null (got 1)"),
        ("collaboration.target_group_size=0", "collaboration.target_group_size must be > 1 or null (got 0)"),
        ("collaboration.target_group_size=2.5", "collaboration.target_group_size"),
        (
            "collaboration.max_concurrent_state_uploads=0",
            "collaboration.max_concurrent_state_uploads must be >= 1 or null (got 0)",
        ),
        ("collaboration.max_concurrent_state_uploads=many", "collaboration.max_concurrent_state_uploads"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(CONFIG, [override])
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_keys_reach_every_averager_and_unset_keys_leave_hiveminds_defaults():
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    built = []
    try:
        keys = dict(target_group_size=4, max_concurrent_state_uploads=1)
        sync = make_collaborative_optimizer(
            dht, OneWeightTask(), CollaborationConfig(run_id="keys_sync", target_batch_size=4, **keys), 1
        )
        built.append(sync)
        diloco = make_collaborative_optimizer(
            dht,
            OneWeightTask(),
            CollaborationConfig(run_id="keys_diloco", target_batch_size=4, semantics=Semantics.diloco, **keys),
            1,
        )
        built.append(diloco)
        plain = make_collaborative_optimizer(
            dht, OneWeightTask(), CollaborationConfig(run_id="keys_plain", target_batch_size=4), 1
        )
        built.append(plain)
        monitor = make_checkpoint_state_averager(
            dht, OneWeightTask(), CollaborationConfig(run_id="keys_monitor", **keys), prefix="keys_monitor"
        )
        built.append(monitor)

        for averager in (sync.grad_averager, sync.state_averager, diloco.state_averager, diloco.outer_averager):
            assert averager.matchmaking_kwargs["target_group_size"] == 4
        # the state averagers serve the state (the monitor its checkpoint); the others serve nothing newcomers ask for
        for averager in (sync.state_averager, diloco.state_averager, monitor):
            assert getattr(averager, LIMIT_ATTRIBUTE) == 1
        assert getattr(sync.grad_averager, LIMIT_ATTRIBUTE, None) is None
        for averager in (plain.grad_averager, plain.state_averager):
            assert averager.matchmaking_kwargs["target_group_size"] is None
            assert getattr(averager, LIMIT_ATTRIBUTE, None) is None
    finally:
        for item in reversed(built):
            item.shutdown()
        dht.shutdown()


class _HeldDonor(DecentralizedAverager):
    """Produces its state (in this, its host process) only once the test lets it: a download held in flight, as
    one on a slow uplink is."""

    serving, release = threading.Event(), threading.Event()

    def get_current_state(self):
        type(self).serving.set()
        assert type(self).release.wait(timeout=60)
        return super().get_current_state()


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_donor_at_its_limit_turns_a_second_newcomer_away_at_once_and_serves_it_once_free():
    """The only donor (``max_state_uploads=1``) is serving one newcomer: a second one is answered with nothing at
    once (hivemind's "ask the next peer"; there is none) instead of waiting behind the first, and loads the state
    when it asks again after the first download ended. The limit is set before the donor's process forks and is
    counted there, where requests are served. Without the limit the second request waits for the first (the test
    times out on it)."""
    state = torch.arange(1024, dtype=torch.float32)
    dhts = [hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)]
    entry = [str(address) for address in dhts[0].get_visible_maddrs()]
    dhts += [hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=entry, start=True) for _ in range(2)]
    averagers = []
    _HeldDonor.serving.clear()
    _HeldDonor.release.clear()
    try:
        options = dict(prefix="upload_limit", target_group_size=2, next_chunk_timeout=30, start=True)
        averagers.append(_HeldDonor([state.clone()], dht=dhts[0], max_state_uploads=1, **options))
        first, second = (
            _HeldDonor([torch.zeros(1024)], dht=dht, allow_state_sharing=False, **options) for dht in dhts[1:]
        )
        averagers += [first, second]
        deadline = time.monotonic() + 30
        while not dhts[2].get("upload_limit.all_averagers", latest=True) and time.monotonic() < deadline:
            time.sleep(0.2)  # the donor declares that it shares state
        serving_first = first.load_state_from_peers(wait=False)
        assert _HeldDonor.serving.wait(timeout=30)
        assert second.load_state_from_peers(wait=False).result(timeout=20) is None  # turned away at once
        _HeldDonor.release.set()
        loaded = serving_first.result(timeout=30)
        assert loaded is not None and torch.equal(loaded[1][0], state)
        again = second.load_state_from_peers(wait=False).result(timeout=30)  # the slot is free again
        assert again is not None and torch.equal(again[1][0], state)
    finally:
        _HeldDonor.release.set()
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
