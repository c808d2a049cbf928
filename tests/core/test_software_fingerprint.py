"""Peers of one run must run the same hivemind release and the same patch set over it."""

import hivemind
import pytest
from hivemind.utils import get_dht_time

from common.backends import RunFingerprints, require_same_model
from common.errors import PeerError
from common.hivemind_compat import PATCH_SET_VERSION, PINNED_VERSION, require_pinned_hivemind, software_fingerprint
from common.metrics import PeerMetrics, metrics_key


def test_the_fingerprint_names_the_release_and_the_patch_set():
    assert software_fingerprint() == f"hivemind {PINNED_VERSION} + patch set {PATCH_SET_VERSION}"
    assert RunFingerprints("layout").software == software_fingerprint()


def test_another_hivemind_release_is_refused_in_one_line(monkeypatch):
    require_pinned_hivemind()
    monkeypatch.setattr(hivemind, "__version__", "1.2.0")
    with pytest.raises(PeerError) as raised:
        require_pinned_hivemind()
    message = str(raised.value)
    assert "hivemind 1.2.0 is installed" in message and PINNED_VERSION in message and "\n" not in message


@pytest.mark.timeout(60)
def test_a_peer_with_another_patch_set_is_refused_naming_both():
    ours = RunFingerprints("layout", "inputs")
    theirs = "hivemind 1.1.12 + patch set 2020.1.1"
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        record = PeerMetrics(
            peer_name="trainer0", role="trainer", recent=[], model_fingerprint="layout", software_fingerprint=theirs
        )
        dht.store(metrics_key("run"), record.dict(), get_dht_time() + 60, subkey=b"trainer0")
        with pytest.raises(PeerError) as raised:
            require_same_model(dht, "run", ours)
        message = str(raised.value)
        assert theirs in message and ours.software in message and "\n" not in message
        record.software_fingerprint = ours.software
        dht.store(metrics_key("run"), record.dict(), get_dht_time() + 60, subkey=b"trainer0")
        require_same_model(dht, "run", ours)  # the same software joins
    finally:
        dht.shutdown()
