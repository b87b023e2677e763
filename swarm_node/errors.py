"""The project's error taxonomy. A peer's misbehaviour is data (log one line, go on);
a bug is a crash."""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(SwarmError, ValueError):
    """A setting is wrong; the message says what to change."""


class PeerError(SwarmError):
    """Something went wrong with one remote peer; retry elsewhere."""


class PeerTimeout(PeerError):
    """A remote call ran past its deadline."""


class ProtocolError(PeerError):
    """A peer sent bytes that do not parse as a valid message (size, type, dtype, shape,
    finiteness, version or run-spec hash)."""


class Oversize(ProtocolError):
    """A frame's length prefix over its protocol's cap: refused before its body is read."""


class StreamClosed(PeerError):
    """The stream ended before the answer was read: the peer closed it unread (it refuses
    us, or dropped the request), or a reset inside the libp2p daemons overtook the answer
    (seen about once per thousand healthy calls on loopback)."""


class OutOfScale(ProtocolError):
    """A well-formed tensor far out of the scale recently seen: refused, but no fault of
    the sender's (honest activations grew 100x within seconds early in a run)."""


class PeerRefused(PeerError):
    """A peer answered but declined (busy, banned us, wrong stage)."""


class RoundFailed(SwarmError):
    """An outer round could not complete with a partner; the caller goes local-only."""


class OwnOutputNotFinite(SwarmError):
    """What this node computed for the next stage is not finite (its weights diverged, or
    a value outgrew the wire codec): not sent, since the peer would refuse it and stop
    taking ours."""


class NotEnoughPeers(SwarmError):
    """No live peer could be found where one is needed."""


class IncompatibleRun(SwarmError):
    """The run found in the swarm cannot be joined by this node (run-spec hash or
    software version differs); the message says what to do."""


def known_failure(group: BaseExceptionGroup) -> SwarmError | None:
    """The first SwarmError of a task group's failure when that is all it holds: a known
    failure inside a task reaches the user as its one-line message, not as a task group
    traceback. Anything else is a bug and should propagate."""
    known, rest = group.split(SwarmError)
    if known is None or rest is not None:
        return None
    first: BaseException = known
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


class DataError(SwarmError):
    """Training data on this machine is missing, damaged or does not match the run's
    manifest; the message says what to do. Nothing verified is deleted."""


class DiskFull(DataError):
    """The data cache ran out of room; what verified is kept."""
