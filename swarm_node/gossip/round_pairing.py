"""The outer round's pairing, one interface for both kinds: NoLoCo's pairs (one partner
a round, agreed by proposal: gossip/pairing.py) and DiLoCo's groups (every live peer of
the stage: gossip/group.py).

What it owns: everything a round does differently by its kind, so that the round
(gossip/exchange.py) and the payloads (gossip/payloads.py) never ask which one runs:
whom the round exchanges with and what it ends with (``gather``), whether proposals are
heard and whether a peer seeking now is one to open our round early for, how a
partner's payload is taken (a pair's Delta ahead of its phi, past the reservation; a
group member's whole, from any member), whether our payload goes as two parts, and how
long a served exchange may take. The spec's method picks the kind (``round_pairing``).
The rules themselves stay in pairing.py and group.py, which do no I/O."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from swarm_node.errors import ProtocolError
from swarm_node.gossip.group import GroupRound
from swarm_node.gossip.pairing import PairingCoordinator, PairState, Refused
from swarm_node.wire.frames import FrameLimits, peek_header
from swarm_node.wire.messages import outer_part

GROUP_EARLY_WAIT_S = 5.0  # a member's payload pulls our round forward and waits this long for it to open


@dataclass(frozen=True)
class RoundCalls:
    """What a round's pairing calls out with (the exchange's I/O and bookkeeping)."""
    candidates: Callable[[], list[tuple[str, int]]]  # live peers of our stage: (peer, how likely it accepts)
    propose: Callable[[str, float], Awaitable[None]]  # (peer, timeout_s): returns once it is reserved for us
    send: Callable[[str, Any, float], Awaitable[Any]]  # (peer, our payload, timeout_s): its payload, checked
    on_peer_failure: Callable[[str, str], None]  # (peer, what happened): backed off
    agreed: Callable[[], None]  # the exchange starts now (a group's as it gathers; a pair's once agreed)


class PayloadIntake(Protocol):
    """What a pairing takes a partner's payload with (gossip/payloads.py's PayloadSwap)."""

    limits: FrameLimits

    @property
    def outer_round(self) -> int: ...

    async def take(self, remote: str, request: bytes, part: str | None = None) -> Any: ...

    def on_delta(self, fetched: bool) -> None: ...

    async def round_early(self, wait_s: float) -> None: ...


class RoundPairing(Protocol):
    """One outer round's pairing, as the exchange and the payloads see it. ``state`` and
    ``seeking`` as gossip/pairing.py's PairState and event; ``abandoned``: a peer our
    cancelled proposal or payload may have left reserved for us."""

    state: PairState
    seeking: Any  # asyncio.Event: set while a round is open
    abandoned: str | None
    delta_ahead: bool  # payloads go as two parts, Delta first: a partner's Delta lands before the round ends

    @property
    def served_s(self) -> float: ...  # the deadline of one exchange we serve

    async def gather(self, round_no: int, payload: Any, calls: RoundCalls,
                     expect_request: bool) -> list[tuple[str, Any]]: ...

    def meets_seekers(self) -> bool: ...

    def admit_proposal(self) -> None: ...

    def on_propose(self, remote: str) -> None: ...

    def hold_for(self, remote: str) -> None: ...

    def drop_hold(self, remote: str) -> None: ...

    def withdrawn(self, remote: str) -> bool: ...

    def may_fetch(self, remote: str) -> bool: ...

    async def take(self, remote: str, request: bytes, intake: PayloadIntake) -> None: ...

    def round_over(self) -> None: ...


class PairPairing(PairingCoordinator):
    """NoLoCo: one partner a round, agreed by proposal before any payload moves. Its
    payload goes Delta first, so the partner's Delta moves our steps as soon as it is in
    (ALGORITHM.md 3.1)."""

    delta_ahead = True

    def __init__(self, **settings):
        super().__init__(**settings)
        # a partner's Delta sent ahead of its phi, checked, until the phi comes: (peer, our round, Delta)
        self._partner_delta: tuple[str, int, Any] | None = None
        # (caller, the round it claimed) of the last payload that made a pair here: a repeat
        # of it, sent again after a reset lost our answer, is answered yes and not taken twice
        self._last_taken: tuple[str, Any] | None = None

    @property
    def served_s(self) -> float:
        return self.request_timeout_s

    async def gather(self, round_no: int, payload: Any, calls: RoundCalls,
                     expect_request: bool) -> list[tuple[str, Any]]:
        result = await self.run_round(round_no, payload, candidates=calls.candidates, propose=calls.propose,
                                      send=calls.send, on_peer_failure=calls.on_peer_failure,
                                      expect_request=expect_request)
        return [(result.partner, result.payload)] if result else []

    def meets_seekers(self) -> bool:
        """An idle round opens early for a peer that announces ``seeking`` (rule 7, by looking)."""
        return self.state is PairState.IDLE

    def admit_proposal(self) -> None:
        """Pairs are made by proposals: every one is heard."""

    async def take(self, remote: str, request: bytes, intake: PayloadIntake) -> None:
        """A pair's part (its Delta, then its phi) or a whole payload, only from the peer
        we reserved: the Delta lands at once, the phi completes the pair."""
        try:
            header = peek_header(request, intake.limits)
            part, taken = outer_part(header), (remote, header.get("round"))
        except ProtocolError:
            part = taken = None  # the whole payload's path refuses it: unread if unreserved, else a fault
        if part == "phi" and taken == self._last_taken:
            return  # asked again after a reset lost our answer: it is taken
        if part == "delta":
            if not self.may_fetch(remote):
                raise Refused("no-reservation")
            try:
                delta = await intake.take(remote, request, "delta")
            except BaseException:
                # declined or bad: its phi will not come, so the round is not held
                # for it (a Delta declined rounds apart held a joiner's round 35 s)
                self.release(remote)
                raise
            self._partner_delta = (remote, intake.outer_round, delta)
            intake.on_delta(False)
            return
        # a pair's phi completes its Delta; a whole payload (a peer that sends it so) also pairs
        await self.answer(remote, partial(self._take_phi, remote, request, intake) if part == "phi"
                          else partial(intake.take, remote, request))
        self._last_taken = taken

    async def _take_phi(self, remote: str, request: bytes, intake: PayloadIntake) -> tuple[Any, Any]:
        """A pair's phi, with the Delta it sent ahead of it this round: the whole payload."""
        phi = await intake.take(remote, request, "phi")
        kept, self._partner_delta = self._partner_delta, None
        if kept is None and self.state is PairState.IDLE:
            # our round ended between its Delta and its phi (we are stopping): nobody's fault
            # (a node stopped mid-exchange logged its honest partner as a bad peer)
            raise Refused("round-over")
        if kept is None or kept[:2] != (remote, intake.outer_round):
            raise ProtocolError("sent its phi without its Delta")
        return phi, kept[2]

    def round_over(self) -> None:
        """A Delta whose phi never came is dropped."""
        self._partner_delta = None


class GroupPairing(GroupRound):
    """DiLoCo: every live peer of the stage, no proposals; a member's payload goes whole
    (a member needs every other's Delta before any moves its steps) and may pull our
    round forward."""

    delta_ahead = False
    abandoned: str | None = None  # nothing is reserved for us: there is nothing to withdraw

    @property
    def served_s(self) -> float:
        """A member's link carries several exchanges at once: an answer may take that much longer."""
        return self.call_s(self.most_sharing)

    async def gather(self, round_no: int, payload: Any, calls: RoundCalls,
                     expect_request: bool) -> list[tuple[str, Any]]:
        calls.agreed()  # a group agrees on no partner: its exchange starts as it gathers

        def members() -> list[str]:
            return [peer for peer, _ in calls.candidates()]

        gathered = await self.run_round(round_no, payload, members=members, send=calls.send,
                                        on_peer_failure=calls.on_peer_failure, expect_request=expect_request)
        return list(gathered.items())

    def meets_seekers(self) -> bool:
        """A group's round is pulled forward by its members' payloads, not by looking."""
        return False

    def admit_proposal(self) -> None:
        raise Refused("not-pairing")  # a DiLoCo run exchanges with everyone, no proposals

    def on_propose(self, remote: str) -> None:
        self.admit_proposal()

    def hold_for(self, remote: str) -> None:
        """No proposal opens a group's round: nothing to hold."""

    def drop_hold(self, remote: str) -> None:
        """Nothing was held."""

    def withdrawn(self, remote: str) -> bool:
        return False  # no proposal was taken, so none is taken back

    async def take(self, remote: str, request: bytes, intake: PayloadIntake) -> None:
        """Any member's whole payload, checked; one that comes before our boundary opens
        our round early when we are past half of it."""
        payload = await intake.take(remote, request)
        if self.state is PairState.IDLE:
            await intake.round_early(GROUP_EARLY_WAIT_S)
        self.on_request(remote, payload)

    def round_over(self) -> None:
        """Nothing outlives a group's round here."""


def round_pairing(method: str, *, round_timeout_s: float, exchange_s: float, link_s: float | None,
                  propose_timeout_s: float, own_id: str, served_at_once: int) -> RoundPairing:
    """The pairing the run's method uses: DiLoCo's group, else NoLoCo's pairs."""
    if method == "diloco":  # every live peer of the stage
        return GroupPairing(round_timeout_s=round_timeout_s, request_timeout_s=exchange_s, link_s=link_s,
                            own_id=own_id, served_at_once=served_at_once)
    return PairPairing(round_timeout_s=round_timeout_s, request_timeout_s=exchange_s,
                       propose_timeout_s=propose_timeout_s, own_id=own_id)  # NoLoCo: one random partner
