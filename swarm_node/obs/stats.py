"""What a node has done so far: counted by the components as they work, published in
its record, its status pages, its metrics and the summary it writes at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NodeStats:
    microbatches_done: int = 0
    microbatches_lost: int = 0
    retries: int = 0
    rounds_with_partner: int = 0
    local_only_rounds: int = 0
    tokens: int = 0
    partners: list[str] = field(default_factory=list)
    downloaded_from: str | None = None
    resumed_from_step: int | None = None
    downloaded_digest: str | None = None
    served_digests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # not a field: the summary lists counters; the record carries this separately
        self.last_error = ""

    def note_failure(self, what: str) -> None:
        """The latest thing that went wrong, as the record and the status line show it."""
        self.last_error = what[:160]
