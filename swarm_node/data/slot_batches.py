"""What a stage-0 node of a prepared dataset trains: its slot's shards, fetched ahead.

A run's training shards are cut into units (a shard, or a part of one when there are
more slots than shards). Each pass over the data deals the units out in an order drawn
from (seed, pass): slot k takes every num_slots-th unit, so within a pass the slots'
units are disjoint and each node derives its own without talking. A node claims a slot
in its registry record (``data_slot``); two that claim the same keep it for the smaller
peer id, and the other moves to a free slot (choose_slot), where it goes on from where
it left that slot in this pass, if it trained there before (SlotBatches.switch_slot).
Whose claims are believed is data/claims.py's rule."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from swarm_node.data.cache import ShardCache
from swarm_node.data.fetch import DataFetcher
from swarm_node.data.manifest import FileEntry, Manifest
from swarm_node.data.shard_format import open_shard
from swarm_node.errors import DataError

log = logging.getLogger(__name__)

PREFETCH_UNITS = 2  # units fetched ahead of the one being trained


def choose_slot(own: str, claims: dict[str, int], num_slots: int, current: int | None,
                unconfirmed: dict[str, int] | None = None) -> int:
    """The slot ``own`` should train: its current one unless a peer of ``claims`` (the
    claims believed, peer -> slot) with a smaller id claims it too; else the first slot,
    counting on from the one its id hashes to, that nobody claims (``unconfirmed``
    claims, of peers not yet known to exist, too, where that leaves one); when all are
    taken, the one its id hashes to (shared, the best there is). Starting where the id
    hashes, rather than at slot 0, keeps peers that do not see each other's claims (the
    view of a sharded registry holds part of the stage) off each other's slots."""
    others = {peer: slot for peer, slot in claims.items() if peer != own}
    if current is not None and 0 <= current < num_slots and not any(
            slot == current and precedes(peer, own) for peer, slot in others.items()):
        return current
    start = slot_start(own, num_slots)
    taken = set(others.values())
    unsure = taken | {slot for peer, slot in (unconfirmed or {}).items() if peer != own}
    for avoid in (unsure, taken):
        free = next((s for i in range(num_slots) if (s := (start + i) % num_slots) not in avoid), None)
        if free is not None:
            return free
    return start


def precedes(peer: str, own: str) -> bool:
    """Of two peers that claim one slot, ``peer`` keeps it rather than ``own``."""
    return peer < own


def slot_start(own: str, num_slots: int) -> int:
    """The slot ``own``'s id hashes to: where it starts looking for a free one."""
    return int.from_bytes(hashlib.sha256(own.encode()).digest()[:8], "big") % num_slots


def default_slots(manifest: Manifest, configured: int) -> int:
    return configured if configured > 0 else len(manifest.train)


@dataclass(frozen=True)
class Unit:
    shard: int  # index into manifest.train
    part: int
    parts: int


def slot_units(manifest: Manifest, seed: int, data_pass: int, slot: int, num_slots: int) -> list[Unit]:
    files = len(manifest.train)
    parts = max(1, math.ceil(num_slots / files))
    units = [Unit(f, p, parts) for p in range(parts) for f in range(files)]
    order = np.random.default_rng([seed, data_pass, 0x756E6974]).permutation(len(units))
    return [units[i] for i in order[slot::num_slots]]


@dataclass
class SlotPosition:
    data_pass: int = 0
    unit: int = 0  # index into the slot's units of this pass
    offset: int = 0  # windows consumed in that unit


class SlotBatches:
    """Micro-batches of one slot, read from shards the fetcher brings (``ready`` awaits
    the current one and starts fetching the next); the interface of ShardedBatches."""

    def __init__(self, fetcher: DataFetcher, *, seq_len: int, batch_size: int, seed: int, slot: int,
                 num_slots: int, on_shard: Callable[[str, int], None] = lambda name, data_pass: None):
        self.fetcher = fetcher
        self.cache: ShardCache = fetcher.cache
        self.manifest: Manifest = fetcher.manifest
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.slot, self.num_slots = slot, num_slots
        self.on_shard = on_shard  # (shard name, pass) when a shard starts being trained
        self.position = SlotPosition()
        self._left: dict[int, SlotPosition] = {}  # slot -> where we left it in this pass
        self._units: list[Unit] = []
        self._windows: np.ndarray | None = None  # window starts of the current unit, in order
        self._tokens: np.ndarray | None = None
        self._prefetch: asyncio.Task | None = None
        self.check_slot: Callable[[], None] = lambda: None  # may call switch_slot

    @property
    def part(self) -> tuple[int, int]:
        """(slot, slot count): a checkpoint's data position keeps it under "shard", the key
        of ShardedBatches' part too: one checkpoint layout for both loaders."""
        return self.slot, self.num_slots

    def switch_slot(self, slot: int) -> None:
        """Another peer claims our slot: go on in ``slot`` from where we left it in this
        pass (its start if we never trained there), so a node moved back and forth
        never trains a window twice in a pass."""
        self._left[self.slot] = self.position
        left, data_pass = self._left.pop(slot, None), self.position.data_pass
        self.position = left if left is not None and left.data_pass == data_pass else SlotPosition(data_pass)
        log.info("data: slot %d is another peer's; moving to slot %d of %d (unit %d of this pass)",
                 self.slot, slot, self.num_slots, self.position.unit)
        self.slot = slot
        self._units, self._windows, self._tokens = [], None, None

    def _entry(self, unit: Unit) -> FileEntry:
        return self.manifest.train[unit.shard]

    def _pass_units(self) -> list[Unit]:
        if not self._units:
            self._units = slot_units(self.manifest, self.seed, self.position.data_pass, self.slot,
                                     self.num_slots)
        return self._units

    async def ready(self) -> None:
        """The next batch can be read without waiting: its shard is here."""
        self.check_slot()
        skipped = 0  # units passed over without a batch: all of them means none ever holds one
        while True:
            units = self._pass_units()
            if skipped > 2 * len(units):
                raise DataError(
                    f"no unit of slot {self.slot} holds a batch of {self.batch_size} windows of "
                    f"{self.seq_len + 1} tokens: prepare the data with larger --shard-tokens, or give "
                    "the run fewer data slots"
                )
            if self.position.unit >= len(units):
                self.position = SlotPosition(self.position.data_pass + 1, 0, 0)
                self._units, self._left = [], {}
                continue
            unit = units[self.position.unit]
            if self._windows is None:
                entry = self._entry(unit)
                path = await self.fetcher.fetch(entry)
                self._tokens = await asyncio.to_thread(open_shard, path, vocab_size=self.manifest.vocab_size)
                self._windows = self._unit_windows(unit, len(self._tokens))
                self.on_shard(entry.name, self.position.data_pass)
                self._start_prefetch()
            if self.position.offset + self.batch_size <= len(self._windows):
                return
            if self.position.offset == 0:
                skipped += 1
            self.cache.trained(self._entry(unit).name)
            self.position = SlotPosition(self.position.data_pass, self.position.unit + 1, 0)
            self._windows = None

    def _unit_windows(self, unit: Unit, num_tokens: int) -> np.ndarray:
        window_len = self.seq_len + 1
        order = np.random.default_rng([self.seed, self.position.data_pass, unit.shard]).permutation(
            num_tokens // window_len)
        return order[unit.part::unit.parts] * window_len

    def _start_prefetch(self) -> None:
        if self._prefetch is not None and not self._prefetch.done():
            return
        upcoming = self._upcoming()
        if upcoming:
            self._prefetch = asyncio.get_running_loop().create_task(self._fetch_all(upcoming))

    def _upcoming(self) -> list[FileEntry]:
        units = self._pass_units()[self.position.unit + 1:]
        if len(units) < PREFETCH_UNITS:
            units += slot_units(self.manifest, self.seed, self.position.data_pass + 1, self.slot,
                                self.num_slots)
        current = self._entry(self._pass_units()[self.position.unit]).name
        names = dict.fromkeys(self._entry(u).name for u in units[:PREFETCH_UNITS + 1])
        return [self.manifest.files()[n] for n in names if n != current][:PREFETCH_UNITS]

    async def _fetch_all(self, entries: list[FileEntry]) -> None:
        for entry in entries:
            try:
                await self.fetcher.fetch(entry)
            except Exception as exc:  # a failure here is met again, and raised, when the shard is due
                log.warning("data: prefetching %s failed: %s", entry.name, exc)
                return

    async def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
            await asyncio.gather(self._prefetch, return_exceptions=True)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._windows is None or self.position.offset + self.batch_size > len(self._windows):
            raise RuntimeError("next_batch before ready()")
        starts = self._windows[self.position.offset:self.position.offset + self.batch_size]
        self.position.offset += self.batch_size
        offsets = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        windows = torch.from_numpy(np.asarray(self._tokens[offsets], dtype=np.int64))
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        p = self.position
        return {"pass": p.data_pass, "unit": p.unit, "offset": p.offset}

    def load_state_dict(self, state: dict) -> None:
        self.position = SlotPosition(int(state["pass"]), int(state["unit"]), int(state["offset"]))
        self._units, self._windows, self._tokens, self._left = [], None, None, {}
