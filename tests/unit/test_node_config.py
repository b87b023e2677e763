"""Peer-local settings: the checks at construction and the derived deadlines."""

import pytest

from swarm_node.node_config import NodeConfig


def test_small_stages_keep_the_exchange_timeout_floor():
    assert NodeConfig().exchange_timeout_for(2 * 1_000_000 * 2) == 30.0  # 1M parameters in fp16


def test_large_stages_get_a_deadline_that_fits_both_payloads_at_the_slowest_link():
    payload = 2 * 50_000_000 * 2  # phi and Delta of 50M parameters in fp16: 200 MB
    # 200 MB each way at 20 Mbit/s is 80 s, so 160 s for the exchange, and half again as slack
    assert NodeConfig().exchange_timeout_for(payload) == pytest.approx(240.0)
    assert NodeConfig(slowest_link_mbit_s=200.0).exchange_timeout_for(payload) == pytest.approx(30.0)


@pytest.mark.parametrize("bad", [{"slowest_link_mbit_s": 0.0}, {"checkpoint_every_rounds": 0},
                                 {"heartbeat_s": 10.0, "record_ttl_s": 15.0}, {"compute_share": 0.0},
                                 {"compute_share": 1.5}])
def test_inconsistent_settings_are_refused(bad):
    with pytest.raises(ValueError):
        NodeConfig(**bad)
