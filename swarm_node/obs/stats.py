"""What a node has done so far: counted by the components as they work, published in
its record, its status pages, its metrics and the summary it writes at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BoundaryBytes:
    """What crossed one stage boundary at this node, for the micro-batches that crossed
    it both ways: frame bytes sent and received (values, scales, headers, targets), and
    their tokens."""
    sent: int = 0
    received: int = 0
    tokens: int = 0

    def note(self, sent: int, received: int, tokens: int) -> None:
        self.sent += sent
        self.received += received
        self.tokens += tokens

    def per_token(self) -> dict[str, float]:
        tokens = max(1, self.tokens)
        return {"sent": round(self.sent / tokens, 2), "received": round(self.received / tokens, 2),
                "tokens": self.tokens}


@dataclass
class NodeStats:
    microbatches_done: int = 0
    microbatches_lost: int = 0
    retries: int = 0
    rounds_with_partner: int = 0
    local_only_rounds: int = 0
    # of the local-only rounds: no other peer was in the stage (the plan, not a failure)
    rounds_alone: int = 0
    tokens: int = 0
    proposals_sent: int = 0  # pairing proposals we made (gossip/pairing.py)
    proposals_refused: int = 0  # of those, answered no (busy, not ready, another round)
    proposals_refused_busy: int = 0  # of those, by a peer seeking, proposing or exchanging with another
    proposals_refused_not_ready: int = 0  # of those, by a peer not at its round's end yet
    proposal_s: float = 0.0  # seconds our proposals took to be answered, summed (a control round trip each)
    partners: list[str] = field(default_factory=list)
    downloaded_from: str | None = None
    resumed_from_step: int | None = None
    downloaded_digest: str | None = None
    served_digests: list[str] = field(default_factory=list)
    states_refused: int = 0  # downloaded states the stage's other replicas disowned (state/check.py)
    state_check: str = ""  # the last verdict on a downloaded state, one line
    state_check_s: float = 0.0  # asking witnesses and weighing their votes, summed
    state_download_s: float = 0.0  # fetching states, checks included, summed
    # the critical path of the outer rounds, summed (divide by the rounds, or by the
    # rounds with a partner, for a mean): boundary to outer step, and its parts
    round_s: float = 0.0
    round_prepare_s: float = 0.0  # snapshot and encoding (compute)
    round_to_partner_s: float = 0.0  # boundary to an agreed partner (rounds with a partner)
    round_exchange_s: float = 0.0  # partner agreed to its payload in and checked
    round_exchanges: int = 0
    round_close_s: float = 0.0  # decoding, checks, the outer step (compute)
    # steps held after a boundary for the partner's Delta, the last exchange having
    # outlasted its steps (a wait moved from the next boundary, not an added one)
    round_waited_first_s: float = 0.0
    # the boundaries this node's stage shares with the next stage (its hops) and the one
    # before (the micro-batches it serves)
    to_next: BoundaryBytes = field(default_factory=BoundaryBytes)
    from_previous: BoundaryBytes = field(default_factory=BoundaryBytes)
    link_wait_s: float = 0.0  # stage 0: seconds it held a full window (its link's and the later stages' time)

    def boundaries(self, stage: int | None) -> dict[str, dict[str, float]]:
        """Bytes per token across each boundary this node crossed, by boundary ("0-1")."""
        out = {}
        if stage is not None and self.to_next.tokens:
            out[f"{stage}-{stage + 1}"] = self.to_next.per_token()
        if stage is not None and self.from_previous.tokens:
            out[f"{stage - 1}-{stage}"] = self.from_previous.per_token()
        return out

    def __post_init__(self) -> None:
        # not a field: the summary lists counters; the record carries this separately
        self.last_error = ""

    def note_round(self, seconds: float, prepare_s: float, close_s: float, *, to_partner_s: float | None,
                   exchange_s: float | None) -> None:
        self.round_s += seconds
        self.round_prepare_s += prepare_s
        self.round_close_s += close_s
        self.round_to_partner_s += to_partner_s or 0.0
        if exchange_s is not None:
            self.round_exchange_s += exchange_s
            self.round_exchanges += 1

    def note_failure(self, what: str) -> None:
        """The latest thing that went wrong, as the record and the status line show it."""
        self.last_error = what[:160]


def training_until(last_step_at: float | None, last_round_opened_at: float | None, now: float) -> float:
    """Where a node's training time (compute utilisation's clock) ends: at its last inner
    step, or at the opening of the round that step made due if the steps stood there for
    a round still under way. The last round's exchange is owed to a partner, not time
    the node could compute; a wait before it is a boundary's like any other, whether it
    comes after the last steps or, moved ahead of them (ALGORITHM.md 3.1), before."""
    if last_step_at is None:
        return now
    return max(last_step_at, last_round_opened_at or last_step_at)
