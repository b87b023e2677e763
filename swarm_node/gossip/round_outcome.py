"""One outer round's record (its critical path, for the stats and the round's log line)
and how a finished round is counted: with a partner, alone in the stage by plan, or
local-only for want of one."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from swarm_node.net.transport import short_id
from swarm_node.obs.stats import NodeStats

log = logging.getLogger("swarm_node.gossip.exchange")  # the round's lines, as operators grep them


@dataclass
class RoundOutcome:
    """One round and its critical path: preparing the payload, finding a partner, the
    payloads moving, the outer step (times on the loop's clock: time.monotonic on a
    real loop)."""
    round_no: int
    started_at: float = 0.0
    partners: list[str] = field(default_factory=list)
    seconds: float = 0.0  # from the boundary to the outer step applied
    proposals: int = 0  # proposals we sent
    alone: bool = False  # nobody else was in the stage (as our view had it): local-only by plan
    prepare_s: float = 0.0  # snapshot, our own Delta's scale, encoding
    partner_at: float | None = None  # when the partner was agreed (its proposal or ours accepted)
    exchange_s: float | None = None  # from the partner agreed to its payload in and checked
    delta_in_s: float | None = None  # from the partner agreed to its Delta in, checked and landed
    waited_first_s: float = 0.0  # steps held after the boundary for the partner's Delta (waiting first)
    close_s: float = 0.0  # decoding, checks, the outer step
    ended_at: float = 0.0


def count_round(stats: NodeStats, outcome: RoundOutcome, had_company: bool, *, alone_before: bool) -> bool:
    """Counts ``outcome`` in ``stats`` and logs it; returns whether the round was alone
    (the next call's ``alone_before``: "no other peer" is logged once, not every round)."""
    stats.note_round(outcome.seconds, outcome.prepare_s, outcome.close_s,
                     to_partner_s=outcome.partner_at - outcome.started_at
                     if outcome.partners and outcome.partner_at is not None else None,
                     exchange_s=outcome.exchange_s)
    stats.round_waited_first_s += outcome.waited_first_s
    if not outcome.partners:
        stats.local_only_rounds += 1
        if had_company:  # alone in the stage, a local-only round is the plan, not a failure
            stats.note_failure(f"round {outcome.round_no}: no partner, local-only step")
            log.info("round %d: no partner found in %.1fs, local-only step", outcome.round_no,
                     outcome.seconds)
        else:
            stats.rounds_alone += 1
            if not alone_before:  # once, not every round (a few a second with a small H)
                log.info("round %d: no other peer in our stage; local-only steps until one joins",
                         outcome.round_no)
    else:
        stats.rounds_with_partner += 1
        stats.partners.extend(outcome.partners)
        log.info("round %d: averaged with %s in %.2fs", outcome.round_no,
                 ", ".join(short_id(p) for p in outcome.partners), outcome.seconds)
    return not had_company
