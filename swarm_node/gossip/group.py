"""DiLoCo's outer round without a central coordinator: every live peer of the stage
contributes (phi, Delta) and every node averages over all contributions it holds.

Each exchange is symmetric (the caller sends its payload and fetches the receiver's,
both at once), so one successful exchange between two nodes gives both of them each
other's contribution, and of each pair the lower peer id calls: the higher calls a
lower one only when its call has not come in the time the link needs for it (it may be
late, gone, or not count us among the members); when both called, every payload crossed
each link twice. A node keeps calling the live peers whose contribution it lacks until it
holds everyone's or the round deadline passes; peers that are not at their boundary
yet answer ``not-ready`` and are asked again. This is the all-reduce's global barrier
that NoLoCo avoids: the round lasts as long as its slowest member, and every member's
link carries every other member's payload.

Why gather rather than all-reduce (a butterfly moves about two payloads a member, here
M - 1 cross each link): in a public swarm every contribution is untrusted, and a node
that averages what it received checks each one itself (partner_check.py), so a bad peer
spoils only its own share; with an all-reduce each member's part of the average is
summed by one peer that nobody can check."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from swarm_node.errors import PeerError
from swarm_node.gossip.pairing import PairState, Refused, backoff, now

log = logging.getLogger(__name__)


class GroupRound:
    def __init__(self, *, round_timeout_s: float, request_timeout_s: float, max_parallel: int = 4,
                 backoff_s: tuple[float, float] = (0.05, 0.3), rng: random.Random | None = None,
                 own_id: str = "",
                 served_at_once: int, link_s: float | None = None):
        self.round_timeout_s = round_timeout_s
        self.request_timeout_s = request_timeout_s  # one exchange with the link to itself
        # what of it the link takes (the rest is a floor): the part that grows when exchanges share the link
        self.link_s = request_timeout_s if link_s is None else link_s
        self.max_parallel = max_parallel
        self.served_at_once = served_at_once  # calls into us at once: the payload protocols' serve limit
        self.own_id = own_id  # "": call every member (no tie-break)
        self.backoff_s = backoff_s
        self.rng = rng or random.Random()
        self.state = PairState.IDLE
        self.seeking = asyncio.Event()  # set while a round is open for requests
        self.received: dict[str, Any] = {}
        self._changed = asyncio.Event()

    def on_request(self, remote: str, payload: Any) -> None:
        if self.state is PairState.IDLE:
            raise Refused("not-ready")
        self.received[remote] = payload
        self._changed.set()

    def may_fetch(self, remote: str) -> bool:
        """Any member may have our contribution while our round is open."""
        return self.state is not PairState.IDLE

    @property
    def most_sharing(self) -> int:
        """The most exchanges a member's link carries at once: its own calls and those served."""
        return self.max_parallel + self.served_at_once

    def call_s(self, sharing: int) -> float:
        """One exchange's deadline while ``sharing`` exchanges share the link."""
        return max(self.request_timeout_s, self.link_s * sharing)

    def deadlines(self, others: int) -> tuple[float, float, float]:
        """(the whole gather's, one call's, the wait for a lower member's call) among
        ``others`` peers. A member's exchanges share its link: a call may take as long as
        the exchanges beside it (a lower member's is in by then, or will not come), and
        the gather moves every other member's payload over the link, and leaves time for
        the calls that did not come. Sized for one exchange, calls among 4 members on a
        4 Mbit/s uplink timed out and half the rounds went local-only (bench.home_link)."""
        others = max(1, others)
        sharing = min(others, self.most_sharing)
        wait_s = self.link_s * sharing
        return max(self.round_timeout_s, self.link_s * others + wait_s), self.call_s(sharing), wait_s

    async def run_round(self, round_no: int, own_payload: Any, members: Callable[[], list[str]],
                        send: Callable[[str, Any, float], Awaitable[Any]],
                        on_peer_failure: Callable[[str, str], None] = lambda peer, why: None,
                        expect_request: bool = False) -> dict[str, Any]:
        """Returns the contributions gathered (peer -> payload), ours excluded."""
        self.received = {}
        self.state = PairState.SEEKING
        self.seeking.set()
        started = now()
        gather_s, call_s, wait_s = self.deadlines(len(members()))
        deadline = started + gather_s
        gate = asyncio.Semaphore(self.max_parallel)

        def ours_to_call(peer: str) -> bool:
            return not self.own_id or peer > self.own_id or now() - started >= wait_s

        async def ask(peer: str) -> None:
            async with gate:
                remaining = deadline - now()
                if remaining <= 0 or peer in self.received:
                    return
                try:
                    self.received[peer] = await send(peer, own_payload, min(call_s, remaining))
                    self._changed.set()
                except Refused:
                    pass
                except PeerError as exc:
                    on_peer_failure(peer, f"round {round_no}: {peer[-6:]} failed: {exc}")

        try:
            while True:
                missing = [p for p in members() if p not in self.received]
                if not missing or now() >= deadline:
                    return dict(self.received)
                self._changed.clear()
                async with asyncio.TaskGroup() as tg:
                    for peer in filter(ours_to_call, missing):
                        tg.create_task(ask(peer))
                if all(p in self.received for p in members()):
                    continue
                await backoff(self._changed, self.rng, self.backoff_s, deadline)
        finally:
            self.state = PairState.IDLE
            self.seeking.clear()
