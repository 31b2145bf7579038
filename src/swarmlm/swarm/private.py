"""Private swarms: a shared secret (the swarm key) keeps outsiders from reading or writing the swarm's DHT records
and from calling its servers.

go-libp2p can close a whole network to peers without a pre-shared key (`pnet`, the `swarm.key` file of IPFS), but
the p2pd daemon shipped with hivemind 1.1.12 is built without it (no `-psk` flag, no pnet in the binary), so the
key works at the application layer, on top of libp2p's authenticated channels:

- DHT records: every value is encrypted and authenticated (ChaCha20-Poly1305, a key derived from the swarm key,
  the record's key, subkey and expiration bound as associated data) by SwarmKeyValidator, which runs in every member
  node: members store and accept only records that decrypt, so an outsider can neither read the swarm's records nor
  add its own. The DHT key names are blinded too (`blind_prefix`): an outsider cannot even ask for them.
- Servers: a member proves it holds the key once per server with a token bound to its own peer id
  (HMAC(key, peer id): libp2p's secure channel proves the peer id, so a token seen on the wire is useless to any
  other peer). A server answers every other peer's request with a short "private swarm" refusal without decoding
  it.

What this does not do: an outsider's DHT node can still connect to members' nodes and take part in DHT routing (it
sees opaque, blinded keys and ciphertext, and can drop what it is asked to store), and it can learn members'
addresses and peer ids from libp2p itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer

from swarmlm.errors import SwarmError

logger = logging.getLogger(__name__)

# the first line of go-libp2p's swarm.key format, which this module reads and writes
KEY_HEADER = "/key/swarm/psk/1.0.0/"
KEY_ENCODING = "/base16/"
KEY_BYTES = 32
# marks an encrypted record value
_MARK = b"swarmlm-private-v1:"
_NONCE_BYTES = 12
# name of the stream a member proves its membership on (not an rpc_* method: it has no reply message)
JOIN_HANDLER = "swarmlm.join"
TOKEN_BYTES = 32
JOIN_OK, JOIN_REFUSED = b"\x01", b"\x00"
# what a server answers a peer that did not prove it holds the swarm key
OUTSIDER_REFUSAL = "this swarm is private: the server accepts requests only from peers holding its swarm key"


def generate_swarm_key(path: str | os.PathLike) -> None:
    """Write a new random swarm key (go-libp2p's swarm.key format), readable by its owner only."""
    text = f"{KEY_HEADER}\n{KEY_ENCODING}\n{secrets.token_hex(KEY_BYTES)}\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def load_swarm_key(path: str | os.PathLike) -> bytes:
    """The 32-byte secret of a swarm key file (go-libp2p's swarm.key format, or just the 64 hex digits)."""
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise SwarmError(f"cannot read the swarm key {path}: {e}") from e
    if lines[:2] == [KEY_HEADER, KEY_ENCODING]:
        lines = lines[2:]
    try:
        key = bytes.fromhex(lines[0]) if len(lines) == 1 else b""
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise SwarmError(
            f"{path} is not a swarm key: expected {KEY_HEADER!r}, {KEY_ENCODING!r} and {2 * KEY_BYTES} hex digits "
            f"(make one with `swarmlm swarm-key FILE`)"
        )
    return key


def _derive(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, b"swarmlm-private:" + label, hashlib.sha256).digest()


def blind_prefix(dht_prefix: str, key: bytes) -> str:
    """The DHT prefix members of the swarm use: the public name plus a tag only key holders can compute."""
    return f"{dht_prefix}.{_derive(key, b'prefix:' + dht_prefix.encode()).hex()[:32]}"


def membership_token(key: bytes, peer_id: str) -> bytes:
    """What the peer `peer_id` sends to prove it holds the swarm key (worthless to any other peer id)."""
    return _derive(key, b"member:" + peer_id.encode())


def is_member_token(key: bytes, peer_id: str, token: bytes) -> bool:
    return hmac.compare_digest(membership_token(key, peer_id), token)


class SwarmKeyValidator(RecordValidatorBase):
    """Encrypts this node's records and accepts only records encrypted with the swarm key (see module doc)."""

    def __init__(self, key: bytes):
        self._key = _derive(key, b"dht-records")  # raw bytes: the validator is copied into the DHT's child process

    def sign_value(self, record: DHTRecord) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = ChaCha20Poly1305(self._key).encrypt(nonce, record.value, _associated(record))
        return _MARK + nonce + sealed

    def validate(self, record: DHTRecord) -> bool:
        return self._open(record) is not None

    def strip_value(self, record: DHTRecord) -> bytes:
        opened = self._open(record)
        return b"" if opened is None else opened

    def _open(self, record: DHTRecord) -> bytes | None:
        value = record.value
        if not value.startswith(_MARK) or len(value) < len(_MARK) + _NONCE_BYTES + 16:
            logger.debug("Rejecting a DHT record not encrypted with the swarm key")
            return None
        nonce, sealed = value[len(_MARK) : len(_MARK) + _NONCE_BYTES], value[len(_MARK) + _NONCE_BYTES :]
        try:
            return ChaCha20Poly1305(self._key).decrypt(nonce, sealed, _associated(record))
        except InvalidTag:
            logger.debug("Rejecting a DHT record that does not decrypt with the swarm key")
            return None

    @property
    def priority(self) -> int:
        # above the signature validator (10): signed first, then sealed; opened first, then its signature checked
        return 20

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def _associated(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps([_MARK, record.key, record.subkey, record.expiration_time])


async def join(p2p: P2P, peer: PeerID, key: bytes, timeout_s: float) -> bool:
    """A member's side of joining: prove to the server `peer` that this peer holds the key; whether it accepted."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, JOIN_HANDLER)
    try:
        writer.write(membership_token(key, p2p.peer_id.to_base58()))
        await asyncio.wait_for(writer.drain(), timeout_s)
        answer = await asyncio.wait_for(reader.readexactly(1), timeout_s)
    finally:
        with contextlib.suppress(Exception):
            writer.close()
    return answer == JOIN_OK
