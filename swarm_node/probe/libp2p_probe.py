"""Check a swarm-node from outside, with py-libp2p (PyPI ``libp2p``, on trio).

    python libp2p_probe.py MADDR [--timeout S] [--json] [--security noise|tls]

MADDR is the node's full multiaddr, ending in /p2p/<peer id> (a node logs it as "others
can join through this node with --initial-peers MADDR"). The probe dials it over TCP
with Noise (or TLS 1.3) and yamux, pings it (/ipfs/ping/1.0.0), reads its identify
record (/ipfs/id/1.0.0), and asks its status over ``/swarm-node/status/1.0.0`` with the
node's own framing (docs/PROTOCOL.md). The last line of the output is the verdict:
"OK: ..." and exit status 0, or one line saying what failed and a non-zero status.

This file is a standalone program, with its frame code beside it (probe_frames.py):
they import py-libp2p, trio, msgpack, multiaddr and the standard library, and nothing
from swarm_node. py-libp2p cannot share a process (nor an environment) with hivemind;
`swarm-node probe --setup` makes it a virtual environment of its own. The frame code
needs only msgpack, so tests check it against swarm_node.wire.frames without py-libp2p;
this file is the probe's steps (connect, ping, identify, status) and its command line.

Exit status: 0 the node answered its status; 1 the check failed; 2 bad arguments or
address; 3 py-libp2p is not installed in this Python.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence

try:  # imported from the swarm_node.probe package (tests)
    from . import probe_frames as frames
except ImportError:  # run as a program, ``python -I libp2p_probe.py``: -I leaves this folder off sys.path
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import probe_frames as frames

ProbeFailure = frames.ProbeFailure
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_LIBP2P = 0, 1, 2, 3


# -- the probe (py-libp2p, imported only here) ----------------------------------------
async def probe(maddr_text: str, *, security: str, timeout_s: float, report: dict) -> None:
    """Fill ``report`` step by step; raises ProbeFailure with the verdict when a step fails."""
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.security.tls.transport import PROTOCOL_ID as TLS_ID
    from libp2p.security.tls.transport import TLSTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux

    try:
        peer = info_from_p2p_addr(multiaddr.Multiaddr(maddr_text))
    except Exception as exc:
        raise ProbeFailure(f"bad address {maddr_text!r}: {exc}; give the node's full multiaddr, ending in "
                           "/p2p/<peer id>") from None
    key_pair = create_new_key_pair()
    # Always explicit: py-libp2p's default host would also accept plaintext and secio.
    secure = ({TProtocol(NOISE_ID): NoiseTransport(key_pair, noise_privkey=create_x25519_pair().private_key)}
              if security == "noise" else {TProtocol(TLS_ID): TLSTransport(key_pair)})
    host = new_host(key_pair=key_pair, sec_opt=secure, muxer_opt={TProtocol(YAMUX_ID): Yamux},
                    negotiate_timeout=max(1, int(timeout_s)))
    report.update(peer_id=str(peer.peer_id), probe_peer_id=str(host.get_id()), security=security)
    steps = _Steps(host, peer, maddr_text, report)
    failure: ProbeFailure | None = None
    try:
        with trio.fail_after(timeout_s):
            async with host.run(listen_addrs=[]):
                try:
                    await steps.run()
                # kept out of the host's nurseries, which would wrap it in a group
                except ProbeFailure as exc:
                    failure = exc
    except trio.TooSlowError:
        raise ProbeFailure(f"timed out after {timeout_s:g} s while {steps.current} ({maddr_text})") from None
    if failure is not None:
        raise failure


class _Steps:
    """Connect, ping, identify, status: each fills its part of the report."""

    def __init__(self, host, peer, maddr_text: str, report: dict):
        self.host, self.peer, self.maddr_text, self.report = host, peer, maddr_text, report
        self.current = "connecting"

    async def run(self) -> None:
        from libp2p.custom_types import TProtocol

        host, peer_id, report = self.host, self.peer.peer_id, self.report
        started = time.monotonic()
        try:
            await host.connect(self.peer)
        except Exception as exc:
            raise ProbeFailure(f"cannot connect to {self.maddr_text}: {_connect_reason(exc)}") from None
        report["connected_ms"] = round((time.monotonic() - started) * 1000, 1)
        self.current = "pinging"
        report["ping_ms"] = await _ping(host, peer_id, TProtocol(frames.PING_PROTOCOL))
        self.current = "reading identify"
        report["identify"] = await _identify(host, peer_id, TProtocol(frames.IDENTIFY_PROTOCOL))
        self.current = f"asking {frames.STATUS_PROTOCOL}"
        report["status"] = await _status(host, peer_id, TProtocol(frames.STATUS_PROTOCOL), report)
        if report["status"]["peer_id"] != report["peer_id"]:
            raise ProbeFailure(f"the node's status names peer {report['status']['peer_id']}, not the "
                               f"peer {report['peer_id']} the handshake authenticated")


async def _ping(host, peer_id, protocol) -> float:
    import secrets

    stream = await _open(host, peer_id, protocol, "ping")
    payload = secrets.token_bytes(32)
    started = time.perf_counter()
    try:
        await stream.write(payload)
        echo = await _read_exactly(stream, len(payload))
    except Exception as exc:
        raise ProbeFailure(f"connected, but ping failed: {_reason(exc)}") from None
    finally:
        await _close(stream)
    if echo != payload:
        raise ProbeFailure("connected, but the ping echo did not match what was sent")
    return round((time.perf_counter() - started) * 1000, 2)


async def _identify(host, peer_id, protocol) -> dict:
    import multiaddr
    from libp2p.identity.identify.pb.identify_pb2 import Identify

    stream = await _open(host, peer_id, protocol, "identify")
    try:
        data = await _read_to_end(stream, frames.MAX_IDENTIFY_BYTES)
    except Exception as exc:
        raise ProbeFailure(f"connected, but identify failed: {_reason(exc)}") from None
    finally:
        await _close(stream)
    message = Identify()
    try:  # go-libp2p sends one varint-length-prefixed message, then closes the stream
        length, used = frames.decode_uvarint(data)
        message.ParseFromString(data[used:used + length] if used + length == len(data) else data)
    except Exception as exc:
        raise ProbeFailure(f"connected, but the identify record does not parse: {_reason(exc)}") from None
    addrs = []
    for raw in message.listen_addrs:
        try:
            addrs.append(str(multiaddr.Multiaddr(raw)))
        except Exception:
            addrs.append(f"(unreadable: {raw.hex()})")
    protocols = sorted(message.protocols)
    return {"agent_version": message.agent_version, "protocol_version": message.protocol_version,
            "protocols": protocols, "listen_addrs": addrs,
            "speaks_status": frames.STATUS_PROTOCOL in protocols}


async def _status(host, peer_id, protocol, report: dict) -> dict:
    stream = await _open(host, peer_id, protocol, "status", listed=report["identify"]["protocols"])
    try:
        # No half-close after the request: p2pd ends the whole stream when one side
        # finishes writing, so the node's answer would be lost.
        await stream.write(frames.status_request())
        try:
            prefix = await _read_exactly(stream, frames.LENGTH_BYTES)
        except EOFError:
            raise ProbeFailure(
                "refused: the node closed the stream unanswered: the run is closed to this peer "
                "(or the node banned it for a while)"
            ) from None
        length = int.from_bytes(prefix, "big")
        if length > frames.MAX_STATUS_BYTES:
            raise ProbeFailure(f"bad answer on {frames.STATUS_PROTOCOL}: a frame of {length} bytes")
        frame = await _read_exactly(stream, length)
    except ProbeFailure:
        raise
    except Exception as exc:
        raise ProbeFailure(f"connected, but {frames.STATUS_PROTOCOL} failed: {_reason(exc)}") from None
    finally:
        await _close(stream)
    return frames.parse_status(frame)


async def _open(host, peer_id, protocol, what: str, listed: Sequence[str] = ()):
    from libp2p.protocol_muxer.exceptions import ProtocolNotSupportedError

    try:
        return await host.new_stream(peer_id, [protocol])
    except Exception as exc:
        if _caused_by(exc, ProtocolNotSupportedError) or "not supported" in _reason(exc):
            if what == "status":
                others = ", ".join(p for p in listed if p.startswith("swarm-node/")) or "none"
                raise ProbeFailure(
                    f"connected, but the node does not speak {frames.STATUS_PROTOCOL} (its swarm-node "
                    f"protocols: {others}; an older swarm-node, or not a swarm-node)"
                ) from None
            raise ProbeFailure(f"connected, but the node does not speak {protocol}") from None
        raise ProbeFailure(f"connected, but opening a {what} stream failed: {_reason(exc)}") from None


async def _read_exactly(stream, n: int) -> bytes:
    """Raises EOFError when the stream ends (or is reset) first."""
    from libp2p.network.stream.exceptions import StreamEOF, StreamReset

    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except (StreamEOF, StreamReset):
            chunk = b""
        if not chunk:
            raise EOFError(f"the stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def _read_to_end(stream, max_bytes: int) -> bytes:
    from libp2p.network.stream.exceptions import StreamEOF

    buf = bytearray()
    while True:
        try:
            chunk = await stream.read(max_bytes + 1 - len(buf))
        except StreamEOF:
            return bytes(buf)
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > max_bytes:
            raise ValueError(f"more than {max_bytes} bytes")


async def _close(stream) -> None:
    try:
        await stream.close()
    except Exception:  # the node may have closed or reset it already
        pass


def _chain(exc: BaseException | None) -> list[BaseException]:
    """An exception, its causes and contexts, and the members of groups and
    py-libp2p's MultiError (which carries the errors of every dialled address)."""
    found: list[BaseException] = []
    todo = [exc]
    while todo and len(found) < 64:
        item = todo.pop(0)
        if item is None or any(item is seen for seen in found):
            continue
        found.append(item)
        if isinstance(item, BaseExceptionGroup):
            todo.extend(item.exceptions)
        elif type(item).__name__ == "MultiError" and item.args and isinstance(item.args[0], list):
            todo.extend(item.args[0])
        todo.extend([item.__cause__, item.__context__])
    return found


def _connect_reason(exc: BaseException) -> str:
    for item in _chain(exc):
        if type(item).__name__ == "PeerIDMismatchesPubkey":  # the address is right, its /p2p/ part is not
            actual = re.search(r"remote_peer_id_from_pubkey=(\w+)", str(item))
            return (
                f"the node there is {actual.group(1) if actual else 'another peer'}, not the peer id in the "
                "address (a node that restarted without --identity gets a new one)"
            )
    return _reason(exc)


def _caused_by(exc: BaseException, kind: type) -> bool:
    return any(isinstance(item, kind) for item in _chain(exc))


def _reason(exc: BaseException) -> str:
    """The most telling message in an exception chain, on one line: an OS error's text
    ("Connection refused") beats the wrappers' ("unable to connect to ...")."""
    chain = _chain(exc)
    for item in chain:
        if isinstance(item, OSError) and item.strerror:
            return item.strerror
    texts = [" ".join(str(item).split()) for item in chain]
    texts = [t for t in texts if t]
    return (texts[-1] if texts else type(exc).__name__)[:300]


# -- command line -------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="libp2p_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("maddr", nargs="?", help="the node's multiaddr, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds for the whole check (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--security", choices=sorted(frames.SECURITY_NAMES), default="noise",
                   help="secure channel to offer: noise (default) or tls")
    p.add_argument("--check-install", action="store_true", help="only check that py-libp2p imports")
    p.add_argument("-v", "--verbose", action="store_true", help="show py-libp2p's own log")
    args = p.parse_args(argv)
    if not args.check_install and not args.maddr:
        p.error("MADDR is required")
    if not 0 < args.timeout <= 3600:
        p.error("--timeout must be in (0, 3600] seconds")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import libp2p
        import trio
    except ImportError as exc:
        print(f"py-libp2p is not installed in {sys.executable} ({exc}): run `swarm-node probe --setup`")
        return EXIT_NO_LIBP2P
    logging.getLogger("libp2p").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL + 1)
    version = getattr(libp2p, "__version__", "?")
    if args.check_install:
        print(f"py-libp2p {version} in {sys.executable}")
        return EXIT_OK
    report: dict = {"address": args.maddr, "libp2p_version": version, "ok": False}
    try:
        trio.run(lambda: probe(args.maddr, security=args.security, timeout_s=args.timeout, report=report))
        report.update(ok=True, verdict=frames.verdict(report))
    except ProbeFailure as exc:
        report["verdict"] = str(exc)
    except Exception as exc:  # a py-libp2p error no step expected (often inside an exception group)
        failures = [item for item in _chain(exc) if isinstance(item, ProbeFailure)]
        report["verdict"] = str(failures[0]) if failures else f"probe error: {_reason(exc)}"
    code = (
        EXIT_OK
        if report["ok"]
        else EXIT_USAGE
        if report["verdict"].startswith("bad address")
        else EXIT_FAILED
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join([*_details(report), report["verdict"]]))
    return code


def _details(report: dict) -> list[str]:
    lines = []
    if "connected_ms" in report:
        lines.append(
            f"  connected to {report['peer_id']} in {report['connected_ms']:.0f} ms "
            f"({frames.SECURITY_NAMES[report['security']]} + yamux, py-libp2p {report['libp2p_version']})"
        )
    if "ping_ms" in report:
        lines.append(f"  {frames.PING_PROTOCOL}: {report['ping_ms']:.1f} ms")
    ident = report.get("identify")
    if ident:
        lines.append(
            f"  {frames.IDENTIFY_PROTOCOL}: agent {ident['agent_version']!r}, {ident['protocol_version']!r}; "
            f"lists {frames.STATUS_PROTOCOL}: {'yes' if ident['speaks_status'] else 'no'}"
        )
        lines.append(f"  protocols: {', '.join(ident['protocols'])}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
