"""Processes a test started, and every process they started, found by a tag in their
environment: a test that stops a swarm checks that nothing of it is left running."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path


class TaggedRun:
    def __init__(self, variable: str):
        self.tag = f"{variable}={uuid.uuid4().hex}".encode()

    def env(self) -> dict[str, str]:
        """The environment to start the test's processes in (children inherit it)."""
        name, value = self.tag.decode().split("=", 1)
        return dict(os.environ, **{name: value})

    def running(self) -> list[str]:
        """``pid: command line`` of every live process with the tag."""
        return [f"{pid}: {cmdline[:160]}" for pid, cmdline in self._live()]

    def pids(self, pattern: str = ".") -> list[str]:
        """Pids of live processes with the tag whose command line matches ``pattern``."""
        return [pid for pid, cmdline in self._live() if re.search(pattern, cmdline)]

    def _live(self) -> list[tuple[str, str]]:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if self.tag in environ and state != "Z":
                found.append((proc.name, cmdline))
        return found
