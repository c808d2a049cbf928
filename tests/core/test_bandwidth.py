"""Declared vs measured bandwidth (common/bandwidth.py) and the launcher hooks of common/tools/netns.py."""

import logging

import pytest

from common.bandwidth import LinkMeasurement, bandwidth_for_averager, measure_link_to_initial_peer
from common.tools.netns import EmulatedNetwork, HostSpec


def test_measured_link_wins_over_the_declared_figure_and_both_are_logged(caplog):
    measurement = LinkMeasurement(upload_mbit=9.5, download_mbit=48.0, seconds_each_way=2.0, peer="12D3KooWabc")
    with caplog.at_level(logging.INFO, logger="common.bandwidth"):
        assert bandwidth_for_averager(100.0, measurement) == pytest.approx(9.5)  # the slower direction
    assert "declared 100.0 Mbit/s, measured upload 9.5 / download 48.0" in caplog.text


def test_without_a_measurement_the_declared_figure_is_used(caplog):
    with caplog.at_level(logging.INFO, logger="common.bandwidth"):
        assert bandwidth_for_averager(50.0, None) == 50.0
        assert bandwidth_for_averager(None, None) is None
    assert "not measured" in caplog.text


def test_measuring_needs_a_peer_id_in_the_address():
    with pytest.raises(ValueError, match="lacks the /p2p/"):
        measure_link_to_initial_peer(dht=None, initial_peer="/ip4/10.77.0.1/tcp/4000")


def test_peer_overrides_fit_the_emulated_host():
    network = EmulatedNetwork(
        [
            HostSpec("public", upload_mbit=100, download_mbit=100),
            HostSpec("home", upload_mbit=10, download_mbit=50, accepts_inbound=False),
        ]
    )
    assert network.peer_overrides("public") == [
        "network.host_maddrs=[/ip4/10.77.0.1/tcp/0]",
        "collaboration.bandwidth=100",
    ]
    assert network.peer_overrides("home") == [
        "network.host_maddrs=[/ip4/10.77.0.2/tcp/0]",
        "network.client_mode=true",
        "collaboration.bandwidth=10",
    ]
    assert network.command_prefix_for("home") == ["ip", "netns", "exec", network.namespaces[1]]
    with pytest.raises(KeyError, match="no emulated host named 'nobody'"):
        network.command_prefix_for("nobody")
