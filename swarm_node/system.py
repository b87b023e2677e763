"""Operating-system resources a long-running peer needs."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

WANTED_OPEN_FILES = 65_536
MIN_OPEN_FILES = 4_096  # each peer connection costs the daemon a few descriptors


def use_uvloop() -> None:
    """uvloop is a dependency, but the programs run on plain asyncio too."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def raise_open_file_limit(wanted: int = WANTED_OPEN_FILES) -> int:
    """Raise the soft open-file limit towards ``wanted`` (the libp2p daemon, a child
    process, inherits it); warn when the hard limit keeps it low. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.debug("could not raise the open-file limit: %s", exc)
    if soft < MIN_OPEN_FILES:
        log.warning("open-file limit is %d; a peer with many connections needs more: raise it "
                    "(`ulimit -n %d`, or LimitNOFILE=%d in a systemd unit)", soft, WANTED_OPEN_FILES,
                    WANTED_OPEN_FILES)
    return soft
