"""The multi-host test bed: hosts in network namespaces on one machine, links with a
rate and a round-trip time, and home routers with NAT (see bed.py)."""

from .bed import (
    ClosedOnFailure,
    Host,
    TestBed,
    ensure_iptables,
    host_env,
    remove_leftovers,
    stop,
    unavailable,
)
from .netns import call_in

__all__ = ["ClosedOnFailure", "Host", "TestBed", "call_in", "ensure_iptables", "host_env", "remove_leftovers",
           "stop", "unavailable"]
