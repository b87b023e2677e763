"""What the sync-cost parent and its peer processes share without importing hivemind:
the reply mark of the line protocol, and the board where peers announce ``seeking``."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

REPLY_MARK = "SBA "
SLOT = struct.Struct("<q")


class SeekingBoard:
    """One int64 slot per peer in a shared file: the key of the round a peer is seeking a
    partner in, or 0. Aligned 8-byte writes are atomic on the platforms we run on."""

    def __init__(self, path: Path, num_slots: int):
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), num_slots * SLOT.size)

    @staticmethod
    def create(path: Path, num_slots: int) -> None:
        path.write_bytes(b"\0" * num_slots * SLOT.size)

    def set(self, rank: int, round_key: int) -> None:
        SLOT.pack_into(self._map, rank * SLOT.size, round_key)

    def get(self, rank: int) -> int:
        return SLOT.unpack_from(self._map, rank * SLOT.size)[0]
