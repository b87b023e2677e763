"""How long an outer exchange may take: a floor, the slowest link the run is told of
(NodeConfig.exchange_link_s), and our own uplink as the pipeline measured it, capped."""

from __future__ import annotations

from dataclasses import dataclass

# An exchange's deadline over its payloads' time on the measured link: both payloads, one
# after the other, and half again (as NodeConfig.exchange_link_s)
LINK_GAIN = 3.0
SHARED_BY = 2  # flows on our uplink while a payload moves: it and stage 0's one micro-batch


@dataclass(frozen=True)
class ExchangeTimes:
    round_timeout_s: float  # how long to seek a partner before the local-only step
    exchange_s: float  # one payload exchange, both ways
    link_s: float | None = None  # the slowest link's share of exchange_s (without its floor); None: all of it
    overlapped: bool = True  # inner steps go on while the exchange runs (ALGORITHM.md section 3.1)
    # our payload goes out while the partner's comes in (False: one after the other)
    both_at_once: bool = True
    payload_bytes: int = 0  # our payload, each way
    # the most our measured link may stretch exchange_s to (None: never stretched)
    max_exchange_s: float | None = None

    def deadline_s(self, link_bytes_s: float | None) -> float:
        """One exchange's deadline: ``exchange_s``, stretched to LINK_GAIN times the time our
        payload takes on our own uplink at the rate we measured it carrying the pipeline
        (``link_bytes_s``; it shares the link with one micro-batch while a payload moves:
        SHARED_BY), at most ``max_exchange_s``. Only our own measurement counts: what a
        partner says of its link is a claim."""
        if self.max_exchange_s is None or not self.payload_bytes or not link_bytes_s or link_bytes_s <= 0:
            return self.exchange_s
        link_s = LINK_GAIN * SHARED_BY * self.payload_bytes / link_bytes_s
        return max(self.exchange_s, min(self.max_exchange_s, link_s))

    @property
    def most_s(self) -> float:
        """The longest an exchange's deadline may be (what a served payload may take)."""
        return max(self.exchange_s, self.max_exchange_s or 0.0)
