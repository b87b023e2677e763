"""What the fetcher holds against each source of a prepared dataset's files, and what
each gave. Every table is bounded, whatever number of identities an attacker uses.

- A source that lets a file down (it said "not held" after claiming the file, stalled,
  or said "busy") is dropped for that file for a while; the first time is logged. Every
  let-down but "busy" is a strike, and a verified chunk clears its strikes; at
  MAX_STRIKES in a row it is refused for the rest of the run, counted against it
  (``on_fault``) and logged once. "Busy" is what an honest peer at its caps says: it is
  no strike.
- A source that sends bytes the manifest does not know, or an answer that is not one,
  is refused for the run at once (counted, logged once).
- The initial peers (the host) are never refused for the run: what they get wrong is
  held against them for that file only (damaged bytes: for the rest of the run), so one
  bad file of the host's costs that file, not the dataset."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm_node.net.transport import short_id

log = logging.getLogger(__name__)

DROP_S = 60.0  # a source that let a file down is not asked for it again before this
BUSY_DROP_S = 5.0  # ... when it only said it is busy
MAX_STRIKES = 3  # let-downs in a row without a verified chunk: refused for the run
MAX_TRACKED = 4096  # sources (or source-file pairs) each table remembers
MAX_BY_SOURCE = 256  # sources counted apart in the figures; the rest as "others"
OTHERS = "others"


def short_source(source: str) -> str:
    return source if is_mirror(source) else short_id(source)


def is_mirror(source: str) -> bool:
    return source.startswith(("http://", "https://"))


@dataclass
class FetchStats:
    fetched_bytes: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    _refused: OrderedDict = field(default_factory=OrderedDict)

    @property
    def refused(self) -> set[str]:
        return set(self._refused)


class SourceBook:
    def __init__(self, initial: list[str], on_fault: Callable[[str, str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.initial = set(initial)
        self.on_fault = on_fault
        self.clock = clock
        self.stats = FetchStats()
        self._dropped: OrderedDict[tuple[str, str], float] = OrderedDict()  # (source, file) -> until
        self._strikes: OrderedDict[str, int] = OrderedDict()
        self._noted: OrderedDict[str, None] = OrderedDict()  # sources whose first let-down was logged

    def is_refused(self, source: str) -> bool:
        return source in self.stats._refused

    def usable(self, source: str, name: str) -> bool:
        """Not refused for the run, nor dropped for ``name`` now."""
        if source in self.stats._refused:
            return False
        until = self._dropped.get((source, name))
        if until is None:
            return True
        if self.clock() >= until:
            del self._dropped[(source, name)]
            return True
        return False

    def let_down(self, source: str, name: str, why: str, *, busy: bool = False) -> None:
        """``source`` failed us on ``name``: dropped for it a while; a strike unless busy."""
        self._drop(source, name, BUSY_DROP_S if busy else DROP_S)
        if busy:
            return
        strikes = self._strikes.pop(source, 0) + 1
        self._strikes[source] = strikes
        _bound(self._strikes)
        if strikes >= MAX_STRIKES and source not in self.initial:
            self.refuse(source, f"{why}, {strikes} times in a row")
            return
        if source not in self._noted:
            self._noted[source] = None
            _bound(self._noted)
            log.info("data: not asking %s for %s for %.0f s: %s", short_source(source), name, DROP_S, why)

    def lied(self, source: str, name: str, why: str) -> None:
        """``source`` sent bytes of ``name`` the manifest does not know, or no valid
        answer: refused for the run; an initial peer for this file only."""
        if source in self.initial:
            if (source, name) not in self._dropped or self._dropped[(source, name)] != float("inf"):
                log.warning("data: not asking %s for %s again: %s", short_source(source), name, why)
            self._drop(source, name, float("inf"))
            return
        self.refuse(source, why)

    def refuse(self, source: str, why: str) -> None:
        refused = self.stats._refused
        if source in self.initial:
            return
        if source not in refused:
            refused[source] = None
            while len(refused) > MAX_TRACKED:
                refused.popitem(last=False)
            log.warning("data: refusing %s for the rest of the run: %s", short_source(source), why)
        if not is_mirror(source):
            self.on_fault(source, why)

    def delivered(self, source: str, nbytes: int) -> None:
        """A verified chunk from ``source``: its strikes are forgiven."""
        self._strikes.pop(source, None)
        stats = self.stats
        stats.fetched_bytes += nbytes
        key = source if source in stats.by_source or len(stats.by_source) < MAX_BY_SOURCE else OTHERS
        stats.by_source[key] = stats.by_source.get(key, 0) + nbytes

    def _drop(self, source: str, name: str, seconds: float) -> None:
        key = (source, name)
        until = max(self._dropped.pop(key, 0.0), self.clock() + seconds)
        self._dropped[key] = until
        if len(self._dropped) > MAX_TRACKED:  # the expired go first, then the oldest
            now = self.clock()
            for stale in [k for k, t in self._dropped.items() if t <= now]:
                del self._dropped[stale]
            _bound(self._dropped)


def _bound(table: OrderedDict) -> None:
    while len(table) > MAX_TRACKED:
        table.popitem(last=False)
