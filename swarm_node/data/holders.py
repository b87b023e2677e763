"""Who holds which files of a prepared dataset, as the fetcher believes it: each peer's
answer to `have` (a bitmap over the manifest's file order), kept HOLDINGS_TTL_S.

Peers are asked in rounds, all at once, and a round waits HAVE_WAIT_S at most for its
slowest answer: the initial peers, verified peers (they answered us before, or the node
reached them), and at most MAX_PROBES peers nobody verified (forged records cost one
question each). Every table is bounded."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from swarm_node.data.manifest import MAX_SHARDS, FileEntry, Manifest
from swarm_node.data.serve import data_request, holdings_of
from swarm_node.data.sources import SourceBook, is_mirror
from swarm_node.errors import PeerError, ProtocolError

HOLDINGS_TTL_S = 60.0
HAVE_WAIT_S = 5.0  # a round of `have` questions waits no longer for its slowest answer
MAX_ASKED = 16  # verified peers asked at once which files they hold
MAX_PROBES = 1  # peers nobody verified asked per round
MAX_HOLDINGS = 4096  # peers whose holdings (or good answers) are remembered
HAVE_BYTES = MAX_SHARDS // 8 + 4096  # the largest `have` answer: a bit per file and a header

Call = Callable[[str, bytes, int], Awaitable[tuple[dict, list]]]
BytesOf = Callable[[list], bytes]


class Holders:
    def __init__(self, *, call: Call, bytes_of: BytesOf, book: SourceBook, manifest: Callable[[], Manifest],
                 manifest_sha256: str, peers: Callable[[], list[str]], initial: list[str],
                 verified: Callable[[str], bool], rng: random.Random, clock: Callable[[], float]):
        self.call, self.bytes_of, self.book = call, bytes_of, book
        self.manifest, self.manifest_sha256 = manifest, manifest_sha256
        self.peers, self.initial, self.verified = peers, initial, verified
        self.rng, self.clock = rng, clock
        self.holdings: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()
        self._answered: OrderedDict[str, None] = OrderedDict()  # peers that gave a good answer

    def of(self, entry: FileEntry, *, initial: bool) -> list[str]:
        """The initial peers (or the others) that hold ``entry`` and may be asked for it,
        verified ones first."""
        found = [p for p, (_, files) in self.holdings.items() if entry.name in files
                 and (p in self.initial) == initial and self.book.usable(p, entry.name)]
        self.rng.shuffle(found)
        found.sort(key=lambda p: not self.is_verified(p))
        return found

    def candidates(self) -> list[str]:
        """Every peer that may hold files: the initial peers first, none refused."""
        return [p for p in dict.fromkeys(self.initial + self.peers()) if not self.book.is_refused(p)]

    def is_verified(self, peer: str) -> bool:
        return peer in self._answered or self.verified(peer)

    def answered(self, peer: str) -> None:
        """``peer`` gave a good answer: it exists."""
        if not is_mirror(peer):
            self._answered.pop(peer, None)
            self._answered[peer] = None
            while len(self._answered) > MAX_HOLDINGS:
                self._answered.popitem(last=False)

    async def refresh(self) -> None:
        """Ask the peers whose answer is older than HOLDINGS_TTL_S which files they hold."""
        now = self.clock()
        candidates = self.candidates()
        due = [p for p in candidates if now - self.holdings.get(p, (-1e18, None))[0] > HOLDINGS_TTL_S]
        self.rng.shuffle(due)
        others = [p for p in due if p not in self.initial]
        asked = (
            [p for p in due if p in self.initial]
            + [p for p in others if self.is_verified(p)][:MAX_ASKED]
            + [p for p in others if not self.is_verified(p)][:MAX_PROBES]
        )
        for peer in asked:  # asked now, whatever comes of it: not due again for a while
            self.holdings[peer] = (now, self.holdings.get(peer, (now, frozenset()))[1])
        if asked:
            tasks = [asyncio.create_task(self._ask(p)) for p in asked]
            _, late = await asyncio.wait(tasks, timeout=HAVE_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        listed = set(candidates)
        for peer in [p for p in self.holdings if p not in listed]:
            del self.holdings[peer]
        while len(self.holdings) > MAX_HOLDINGS:
            self.holdings.popitem(last=False)

    async def _ask(self, peer: str) -> None:
        try:
            header, tensors = await self.call(peer, data_request(self.manifest_sha256, "have"), HAVE_BYTES)
            files = frozenset()
            if header.get("ok"):
                files = holdings_of(self.bytes_of(tensors), header.get("count"), self.manifest())
        except (ProtocolError, TypeError, ValueError, RuntimeError) as exc:
            self.book.refuse(peer, f"answered 'have' with something that is not a holdings bitmap ({exc})")
            files = frozenset()
        except PeerError:
            if peer in self.initial:
                return  # what the host held a minute ago it holds still
            files = frozenset()
        else:
            self.answered(peer)
        self.holdings[peer] = (self.holdings.get(peer, (self.clock(), None))[0], files)
