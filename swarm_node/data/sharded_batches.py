"""Deterministic sharding of training windows by (seed, shard id).

Each epoch draws one permutation of the training windows from (seed, epoch); shard k
takes every num_shards-th window of it, so shards are disjoint within an epoch and
every peer derives its shard without talking. The position is explicit state that a
checkpoint can save and restore."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swarm_node.data.dataset import TokenWindows


@dataclass
class ShardPosition:
    epoch: int = 0
    offset: int = 0  # windows consumed in this epoch's shard


class ShardedBatches:
    def __init__(self, data: TokenWindows, *, batch_size: int, seed: int, shard_id: int, num_shards: int):
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} out of range for {num_shards} shards")
        per_shard = data.num_train_windows // num_shards
        if per_shard < batch_size:
            raise ValueError(f"{data.num_train_windows} training windows cannot give {num_shards} shards "
                             f"a batch of {batch_size}; use less data parallelism or more data")
        self.data = data
        self.batch_size = batch_size
        self.seed = seed
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.position = ShardPosition()
        self._epoch_windows: np.ndarray | None = None

    @property
    def part(self) -> tuple[int, int]:
        """(shard id, shard count): what a checkpoint's data position keeps under "shard"."""
        return self.shard_id, self.num_shards

    def shard_windows(self, epoch: int) -> np.ndarray:
        order = np.random.default_rng([self.seed, epoch, 0x73686172]).permutation(self.data.num_train_windows)
        usable = (len(order) // self.num_shards) * self.num_shards  # equal shard sizes
        return order[:usable][self.shard_id::self.num_shards]

    async def ready(self) -> None:
        """Every window is in memory: nothing to wait for (SlotBatches waits for a fetch)."""

    async def close(self) -> None:
        pass

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._epoch_windows is None:
            self._epoch_windows = self.shard_windows(self.position.epoch)
        if self.position.offset + self.batch_size > len(self._epoch_windows):
            self.position = ShardPosition(self.position.epoch + 1, 0)
            self._epoch_windows = self.shard_windows(self.position.epoch)
        start = self.position.offset
        self.position.offset += self.batch_size
        return self.data.batch(self._epoch_windows[start:start + self.batch_size])

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.position.epoch, "offset": self.position.offset}

    def load_state_dict(self, state: dict) -> None:
        self.position = ShardPosition(int(state["epoch"]), int(state["offset"]))
        self._epoch_windows = None
