"""Peer identities and signed DHT records.

A peer's identity file holds its libp2p private key (RSA, libp2p's protobuf form); the
peer id is derived from it, so a peer that keeps the file keeps its id and its
multiaddr across restarts. The same key signs the DHT records the peer owns: a record
whose subkey is ``[owner:<public key>]`` can only be written with that key
(hivemind's RSASignatureValidator, which every peer of ours runs), and since the
public key determines the peer id, a reader can check *which peer* wrote it."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from pathlib import Path

import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm_node.errors import ConfigError

log = logging.getLogger(__name__)


def short_id(peer_id: str) -> str:
    """Logs show the tail of a peer id: the head is the same multihash prefix for everyone."""
    return peer_id[-6:]

_OWNER_RE = re.compile(r"^\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]$")
MAX_OWNER_CHARS = 1024


def ensure_identity(path: str | Path) -> bool:
    """Create the identity file (owner read-only) if missing; True when created. An
    existing file that others can read is reported, not changed."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"the identity file {path} is a folder: give the path of a key file (created on "
                          "first use)")
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning("identity file %s is readable by other users (mode %o); run: chmod 600 %s",
                        path, mode, path)
        load_private_key(path)  # refuse a corrupt file now, with its path in the message
        return False
    if not path.parent.is_dir():
        what = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise ConfigError(f"cannot create the identity file {path}: {path.parent} {what}")
    P2P.generate_identity(str(path))  # writes mode 0400
    return True


def load_private_key(path: str | Path) -> RSAPrivateKey:
    try:
        raw = Path(path).read_bytes()
        der = crypto_pb2.PrivateKey.FromString(raw).data
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": der})  # hivemind's own (un)pickling path for a DER key
        return key
    except OSError as exc:
        raise ConfigError(f"cannot read the identity file {path}: {exc}") from None
    except Exception as exc:  # protobuf and cryptography raise several unrelated types
        raise ConfigError(f"{path} is not a libp2p identity file ({type(exc).__name__}); "
                          "restore it from your backup, or delete it to get a new peer id") from None


def peer_id_of_identity(path: str | Path) -> str:
    return PeerID.from_identity(Path(path).read_bytes()).to_base58()


def record_validator(identity_path: str | Path) -> RSASignatureValidator:
    """The validator every DHT of ours runs: it rejects writes to another peer's
    owner-tagged records and signs our own with the identity key."""
    return RSASignatureValidator(load_private_key(identity_path))


def owner_subkey(validator: RSASignatureValidator) -> str:
    return validator.local_public_key.decode()


def peer_id_of_owner(subkey: object) -> str | None:
    """The peer id whose key an ``[owner:...]`` subkey names, or None if it is not one."""
    if not isinstance(subkey, str) or len(subkey) > MAX_OWNER_CHARS:
        return None
    match = _OWNER_RE.match(subkey)
    if match is None:
        return None
    try:
        public_key = serialization.load_ssh_public_key(match.group(1).encode())
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None
    if not isinstance(public_key, rsa.RSAPublicKey):
        return None
    der = public_key.public_bytes(encoding=serialization.Encoding.DER,
                                  format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def remove_identity(path: str | Path) -> None:
    """Delete a throwaway identity (mode 0400 files need their directory writable only)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
