"""Who is at each end of a direct lane (net/lanes.py): offers, tickets, the lane's TLS
identity, and the proofs a lane opens with.

An offer comes over libp2p, which authenticated both peer ids: the server's lane port,
its certificate's hash and a ticket, a secret the server ties to the caller's peer id.
The ticket is the key of both proofs of the lane's opening (docs/PROTOCOL.md 1.1):

    caller -> server:  LANE_HELLO | challenge (32 random bytes) | SHA-256 of the ticket
    server -> caller:  REFUSED, and it closes;  or  ACCEPTED | server proof | challenge
    caller -> server:  caller proof, then its requests

The server proof is an HMAC of the caller's challenge and the port it was dialled at,
under the ticket: only the peer that gave the ticket can make it, so the caller never
writes the ticket, nor a byte a peer chose, to a socket that has not proven to be that
peer's lane. This holds on plain TCP too (loopback), where no certificate pins the far
end and whatever took over a lane's old port, or a port a peer named, would answer. The
port in the proof keeps a lane server from being relayed through another port. The
caller proof answers the server's challenge, so the ticket never crosses the wire."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import math
import secrets
import ssl
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarm_node.errors import PeerError, ProtocolError
from swarm_node.net.addresses import LOOPBACK

LANE_HELLO = b"swarm-node lane 2\n"
TICKET_BYTES = 32
CHALLENGE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
HELLO_BYTES = len(LANE_HELLO) + CHALLENGE_BYTES + 32  # the line, the caller's challenge, the ticket's hash
ACCEPTED, REFUSED = b"\x01", b"\x00"
TICKET_TTL_S = 600.0
MAX_TICKETS = 4096  # all callers together: past it, the oldest of the address that holds the most goes
MAX_TICKETS_PER_PEER = 4  # past it, the peer's own oldest goes
MAX_TICKETS_PER_ADDRESS = 64  # what callers at one address (or /64) hold together: a NAT's worth of peers
MAX_TICKETS_LOOPBACK = MAX_TICKETS // 4  # a swarm on one machine


@dataclass(frozen=True)
class Offer:
    """What a server told us over libp2p, with the IP we reached it at."""

    host: str
    port: int
    cert_sha256: bytes
    ticket: bytes
    expires_at: float

    def to_wire(self) -> bytes:
        return msgpack.packb({"port": self.port, "cert": self.cert_sha256, "ticket": self.ticket,
                              "ttl": TICKET_TTL_S})

    @classmethod
    def from_wire(cls, raw: bytes, host: str, now: float) -> Offer:
        try:
            m = msgpack.unpackb(raw, raw=True, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: a map keyed by a list
            raise ProtocolError(f"lane offer is not msgpack ({exc})") from None
        if not isinstance(m, dict):
            raise ProtocolError("lane offer is not a map")
        port, cert, ticket, ttl = m.get(b"port"), m.get(b"cert"), m.get(b"ticket"), m.get(b"ttl")
        if not (isinstance(port, int) and 0 < port < 65536 and isinstance(cert, bytes) and len(cert) == 32
                and isinstance(ticket, bytes) and len(ticket) == TICKET_BYTES
                and isinstance(ttl, int | float) and not isinstance(ttl, bool) and not math.isnan(ttl)):
            raise ProtocolError("lane offer has a bad port, certificate hash, ticket or lifetime")
        # its own word on the lifetime is believed only as far as ours goes
        return cls(host, port, cert, ticket, now + min(max(float(ttl), 0.0), TICKET_TTL_S) * 0.9)


def ticket_id(ticket: bytes) -> bytes:
    """What names a ticket on the wire: its hash, not the secret itself."""
    return hashlib.sha256(b"swarm-node lane ticket\n" + ticket).digest()


def server_proof(ticket: bytes, challenge: bytes, port: int) -> bytes:
    return hmac.new(ticket, b"swarm-node lane 2 server\n" + challenge + port.to_bytes(2, "big"),
                    hashlib.sha256).digest()


def caller_proof(ticket: bytes, challenge: bytes) -> bytes:
    return hmac.new(ticket, b"swarm-node lane 2 caller\n" + challenge, hashlib.sha256).digest()


class LaneRefused(PeerError):
    """The lane's server refused our ticket (or closed before saying): no request was sent."""


async def open_lane(io, offer: Offer) -> None:
    """The caller's side of a lane's opening on ``io`` (net/lane_io.py's LaneIO), the
    certificate already checked where there is TLS: raises LaneRefused when the server
    refuses the ticket or closes first, PeerError when what answered is not the lane of
    the peer that gave the ticket."""
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    io.write(LANE_HELLO + challenge + ticket_id(offer.ticket))
    try:
        status = await io.readexactly(1)
    except asyncio.IncompleteReadError:
        raise LaneRefused("the lane closed before its first answer") from None
    if status == REFUSED:
        raise LaneRefused("the lane's server refused our ticket")
    if status != ACCEPTED:
        raise PeerError("what answered at the lane's port is not a lane")
    reply = await io.readexactly(PROOF_BYTES + CHALLENGE_BYTES)
    if not secrets.compare_digest(reply[:PROOF_BYTES], server_proof(offer.ticket, challenge, offer.port)):
        raise PeerError("what answered at the lane's port did not prove it holds our ticket")
    io.write(caller_proof(offer.ticket, reply[PROOF_BYTES:]))  # it goes out with the first request


class LaneIdentity:
    """The TLS key and self-signed certificate of this process's lanes. The certificate
    proves nothing by itself: its hash travels in the offer, over libp2p."""

    def __init__(self):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm-node lane")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=3650)).sign(key, hashes.SHA256()))
        self.cert_sha256 = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()
        self.server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_context.minimum_version = ssl.TLSVersion.TLSv1_3
        # ssl loads a chain from files only: a private directory, gone once loaded
        with tempfile.TemporaryDirectory(prefix="swarm-lane-") as folder:
            cert_path, key_path = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            key_path.touch(mode=0o600)
            key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                   serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
            self.server_context.load_cert_chain(cert_path, key_path)


def client_context() -> ssl.SSLContext:
    """TLS 1.3 with the certificate pinned by hash after the handshake (``check_pin``),
    not by a CA: the offer that came over libp2p is the trust anchor."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def check_pin(der: bytes, cert_sha256: bytes) -> None:
    if not secrets.compare_digest(hashlib.sha256(der).digest(), cert_sha256):
        raise PeerError("the lane's certificate is not the one its offer named")


@dataclass(frozen=True)
class _Ticket:
    secret: bytes
    peer: str
    address: str  # the key (net/addresses.py) of the address the peer asked from
    expires_at: float


class Tickets:
    """Tickets we handed out, each tied to the peer id libp2p authenticated when it asked.

    Identities are free: a flood of them must not push out the tickets of callers that
    hold lanes. A peer's new ticket replaces its own oldest first, then its address's
    oldest (``MAX_TICKETS_PER_ADDRESS``); only a full table takes one from another
    address, the one that holds the most. So a flood from a few addresses replaces its
    own tickets, and a caller whose ticket went anyway is refused at its next lane and
    asks for a new one (net/lanes.py)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._by_id: dict[bytes, _Ticket] = {}
        self._of_peer: dict[str, deque[bytes]] = {}  # oldest first
        self._of_address: dict[str, deque[bytes]] = {}
        self._addresses_of_size: dict[int, dict[str, None]] = {}  # those that reached a size first, first
        self._largest = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def issue(self, peer: str, address: str | None = None) -> bytes:
        """A new ticket for ``peer``, which asked from ``address`` (a key of
        net/addresses.py; None: unknown, all such askers share one key)."""
        address = address if address is not None else ""
        mine = self._of_peer.get(peer)
        if mine is not None and len(mine) >= MAX_TICKETS_PER_PEER:
            self._forget(mine[0])
        theirs = self._of_address.get(address)
        if theirs is not None and len(theirs) >= _address_cap(address):
            self._forget(theirs[0])
        while len(self._by_id) >= MAX_TICKETS:
            most = next(iter(self._addresses_of_size[self._largest]))
            self._forget(self._of_address[most][0])
        secret = secrets.token_bytes(TICKET_BYTES)
        key = ticket_id(secret)
        self._by_id[key] = _Ticket(secret, peer, address, self.clock() + TICKET_TTL_S)
        self._of_peer.setdefault(peer, deque()).append(key)
        held = self._of_address.setdefault(address, deque())
        self._resize(address, len(held), len(held) + 1)
        held.append(key)
        return secret

    def find(self, key: bytes) -> tuple[str, bytes] | None:
        """(the peer, the ticket) that ``key`` (``ticket_id``) names, while it is good (a
        ticket opens several lanes)."""
        found = self._by_id.get(key)
        if found is None:
            return None
        if self.clock() > found.expires_at:
            self._forget(key)
            return None
        return found.peer, found.secret

    def redeem(self, ticket: bytes) -> str | None:
        """The peer a ticket was given to, while it is good."""
        found = self.find(ticket_id(ticket))
        return None if found is None or not secrets.compare_digest(found[1], ticket) else found[0]

    def _forget(self, key: bytes) -> None:
        entry = self._by_id.pop(key)
        mine = self._of_peer[entry.peer]
        mine.remove(key)
        if not mine:
            del self._of_peer[entry.peer]
        held = self._of_address[entry.address]
        self._resize(entry.address, len(held), len(held) - 1)
        held.remove(key)
        if not held:
            del self._of_address[entry.address]

    def _resize(self, address: str, old: int, new: int) -> None:
        """Keeps, for each size, the addresses holding that many tickets: the largest is
        found without a scan (a flood meets a full table at every ticket)."""
        if old:
            same = self._addresses_of_size[old]
            del same[address]
            if not same:
                del self._addresses_of_size[old]
        if new:
            self._addresses_of_size.setdefault(new, {})[address] = None
        self._largest = max(self._largest, new)
        while self._largest and self._largest not in self._addresses_of_size:
            self._largest -= 1


def _address_cap(address: str) -> int:
    return MAX_TICKETS_LOOPBACK if address == LOOPBACK else MAX_TICKETS_PER_ADDRESS
