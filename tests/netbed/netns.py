"""Entering a network namespace from Python: ``setns(2)`` through ctypes (``os.setns``
arrives only in Python 3.12). It switches the calling *thread* only, so callers run
namespace work on a thread of its own and every other thread stays where it was."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextmanager
def entered(namespace: str):
    """The calling thread lives in ``namespace`` inside the block, and back home after."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def call_in(namespace: str, fn: Callable[..., T], *args, timeout_s: float = 60.0, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a fresh thread inside ``namespace``: sockets it opens
    belong to that namespace. Exceptions propagate to the caller."""
    result: dict[str, object] = {}

    def body() -> None:
        try:
            with entered(namespace):
                result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the calling thread below
            result["error"] = exc

    thread = threading.Thread(target=body, name=f"in-{namespace}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(
            f"{getattr(fn, '__name__', fn)} in namespace {namespace} ran past {timeout_s:.0f}s"
        )
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[return-value]
