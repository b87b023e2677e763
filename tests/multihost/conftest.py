"""The multi-host tier: every peer on a host of its own (a network namespace), joined by a
bridge, some behind a NAT, with link rates and round-trip times (tests/netbed). These
tests need root, iproute2 and /dev/net/tun, and iptables for the NAT (installed with
apt-get where missing). Without them they are skipped with the reason, except under CI
(`CI` set), where they fail."""

from __future__ import annotations

import os
import signal

import pytest
from netbed import TestBed, ensure_iptables, unavailable


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def can_build_beds() -> None:
    reason = unavailable()
    if reason:
        _missing(reason)


@pytest.fixture
def bed(can_build_beds):
    with TestBed() as testbed:
        yield testbed


@pytest.fixture(scope="module")
def module_bed(can_build_beds):
    with TestBed("m") as testbed:
        yield testbed


@pytest.fixture(scope="session")
def iptables() -> None:
    reason = unavailable() or ensure_iptables()
    if reason:
        _missing(reason)


@pytest.fixture(scope="session", autouse=True)
def clean_up_on_sigterm():
    """A CI time-out or `kill` sends SIGTERM, which ends pytest without running fixture
    teardown: the beds' hosts and their processes would live on. Taken as Ctrl-C,
    teardown runs."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)
