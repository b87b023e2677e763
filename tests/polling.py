"""Waiting in multi-process tests: poll a condition with a deadline, never sleep for a
guessed time."""

from __future__ import annotations

import time
from pathlib import Path


def wait_for(condition, timeout_s: float, what: str, logs: Path | None = None, interval_s: float = 0.2):
    """The first truthy value of ``condition()`` within ``timeout_s``; else an
    AssertionError naming ``what`` (and where the logs are)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)  # polling interval, not synchronisation
    raise AssertionError(
        f"timed out after {timeout_s}s waiting for {what}" + (f"; logs in {logs}" if logs else "")
    )
