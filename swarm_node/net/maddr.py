"""Multiaddrs a user typed, checked before any daemon starts.

The libp2p daemon parses the multiaddrs it is given only once it runs, and answers a bad
one with its own (Go) text, which reads like a local fault. So each multiaddr of a
command line is parsed here first, by the rules of the multiaddr format (each protocol
name, then its value where it has one), and a bad one is refused with one line naming
the flag, the part that is wrong and what to do. The examples in the docs hold
placeholders (``...``, ``Qm...``); those are refused with a hint that they stand for
the real values."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

from swarm_node.errors import ConfigError

# Protocols with a value, and those without one (go-multiaddr's table).
_PORT_PROTOCOLS = ("tcp", "udp", "dccp", "sctp")
_HOST_PROTOCOLS = ("dns", "dns4", "dns6", "dnsaddr")
_VALUED = frozenset(("ip4", "ip6", "ip6zone", "ipcidr", "p2p", "ipfs", "unix", "onion", "onion3",
                     "garlic64", "garlic32", "sni", "certhash", "memory", *_PORT_PROTOCOLS, *_HOST_PROTOCOLS))
_BARE = frozenset(("quic", "quic-v1", "webtransport", "ws", "wss", "tls", "noise", "http", "https",
                   "p2p-circuit", "webrtc", "webrtc-direct", "p2p-webrtc-star", "p2p-webrtc-direct",
                   "p2p-stardust", "udt", "utp", "plaintextv2"))
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
PLACEHOLDER_HINT = "the docs' ... and Qm... stand for the real values"
PEER_FIX = "copy the whole multiaddr the bootstrap (or node) printed"
LISTEN_FIX = "a listen address reads /ip4/0.0.0.0/tcp/PORT (every interface) or /ip4/127.0.0.1/tcp/PORT"


def check_maddrs(maddrs: Iterable[str], flag: str, *, peer_id: bool = False) -> None:
    """Refuse the first bad multiaddr of ``flag`` with a ConfigError naming it.
    ``peer_id``: each must end in the peer's /p2p/ id (initial peers)."""
    for text in maddrs:
        if peer_id and "p2p" not in text.rstrip("/").split("/")[:-1]:
            raise ConfigError(f"{flag} {text} lacks its peer id: copy the whole multiaddr, ending in "
                              "/p2p/<peer id>")
        problem = maddr_problem(text)
        if problem is not None:
            fix = PEER_FIX if peer_id else LISTEN_FIX
            if "..." in text:
                fix = f"{PLACEHOLDER_HINT}: {fix}"
            raise ConfigError(f"{flag} {text}: {problem}; {fix}")


def maddr_problem(text: str) -> str | None:
    """What is wrong with ``text`` as a multiaddr, or None when it parses."""
    if not text.startswith("/"):
        return "a multiaddr starts with /"
    parts = text.rstrip("/").split("/")[1:]
    if not parts:
        return "the multiaddr is empty"
    i = 0
    while i < len(parts):
        name = parts[i]
        if name in _BARE:
            i += 1
            continue
        if name not in _VALUED:
            return f"unknown protocol {name!r} (e.g. ip4, ip6, dns4, tcp, p2p)"
        if name == "unix":  # its value is the rest of the address, a path
            return None if i + 1 < len(parts) else "unix needs a path"
        if i + 1 >= len(parts) or not parts[i + 1]:
            return f"{name} needs a value after it"
        problem = _value_problem(name, parts[i + 1])
        if problem is not None:
            return problem
        i += 2
    return None


def _value_problem(name: str, value: str) -> str | None:
    if name == "ip4":
        return None if _is_ip(value, ipaddress.IPv4Address) else f"{value!r} is not an IPv4 address"
    if name == "ip6":
        return None if _is_ip(value, ipaddress.IPv6Address) else f"{value!r} is not an IPv6 address"
    if name in _PORT_PROTOCOLS:
        if not (value.isascii() and value.isdigit() and int(value) < 65536):
            return f"{value!r} is not a {name} port (0-65535)"
    elif name in _HOST_PROTOCOLS:
        labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
        if len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            return f"{value!r} is not a host name"
    elif name in ("p2p", "ipfs") and not is_peer_id(value):
        return f"{value!r} is not a peer id"
    return None


def _is_ip(value: str, kind) -> bool:
    try:
        kind(value)
    except ValueError:
        return False
    return True


def is_peer_id(text: str) -> bool:
    """Whether ``text`` is a libp2p peer id in base58: a multihash (code, length, digest),
    as Qm... (SHA-256) and 12D3KooW... (an inlined public key) are."""
    if not 2 <= len(text) <= 128 or any(ch not in _B58_ALPHABET for ch in text):
        return False
    number = 0
    for ch in text:
        number = number * 58 + _B58_ALPHABET.index(ch)
    zeros = len(text) - len(text.lstrip("1"))
    raw = b"\0" * zeros + number.to_bytes((number.bit_length() + 7) // 8, "big")
    code_end = _varint_end(raw, 0)
    length_end = _varint_end(raw, code_end) if code_end is not None else None
    if length_end is None:
        return False
    return len(raw) - length_end == _varint(raw[code_end:length_end])


def _varint_end(raw: bytes, start: int) -> int | None:
    for i in range(start, min(len(raw), start + 9)):
        if raw[i] < 0x80:
            return i + 1
    return None


def _varint(raw: bytes) -> int:
    return sum((byte & 0x7F) << (7 * i) for i, byte in enumerate(raw))


def check_ip(text: str, flag: str) -> None:
    """An address to announce (``--public-ip``)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ConfigError(f"{flag} {text}: not an IPv4 or IPv6 address; give this machine's public address, "
                          "e.g. 203.0.113.7") from None


def unresolved_hosts(maddrs: Iterable[str]) -> list[str]:
    """The /dns, /dns4 and /dns6 host names of ``maddrs`` this machine cannot resolve
    (blocking: call it in a thread)."""
    names = []
    for text in maddrs:
        parts = text.strip("/").split("/")
        if len(parts) >= 2 and parts[0] in ("dns", "dns4", "dns6") and parts[1] not in names:
            try:
                socket.getaddrinfo(parts[1], None)
            except (socket.gaierror, UnicodeError):
                names.append(parts[1])
    return names
