"""Who may write a DHT record: only the owner of peer id X may write the entry with subkey X.

Design. Every swarmlm DHT node (server, client, bootstrap) gets a fresh Ed25519 key, hands it to its p2pd as the
libp2p identity, and so has the peer id `12D3KooW...` derived from it. An Ed25519 peer id *embeds* its public key
(an identity multihash of the protobuf-encoded key), so a record's subkey alone says which key must have signed it:
no key travels in the record and no table of keys is needed. The server announces under its own peer id, which is
also the id the client dials (its RPC P2P is a replica of the DHT's daemon), and libp2p's secure channel proves that
whoever answers that id holds the key. Hence:

- a record "for X" signed with any key other than X's fails validation (an attacker cannot write X's entry);
- a record under the attacker's own id Y with X's addresses only makes clients dial Y, which X's daemon refuses;
- the signature covers key, subkey, value and expiration time, so a captured record cannot be re-dated, and an
  old one (an earlier expiration) never replaces a newer one.

PeerIdSignatureValidator runs inside every honest node's DHT: it signs this node's own records on store and rejects,
both on store requests from others and on values returned by others, every record that has no subkey (a plain
value could overwrite the servers' dictionary), whose subkey is not an Ed25519 peer id, or whose signature does not
verify. Peer ids with RSA keys (`Qm...`) do not embed their key and are therefore not accepted as record owners.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

logger = logging.getLogger(__name__)

# marks the 64-byte Ed25519 signature appended to a record's value
SIGNATURE_MARK = b"|swarmlm-ed25519:"
_SIGNATURE_BYTES = 64
# multihash code of the "identity" hash: the digest is the protobuf-encoded public key itself
_IDENTITY_MULTIHASH = 0x00
# domain separation: a signature over a swarmlm record means nothing anywhere else
_SIGNED_CONTEXT = b"swarmlm-record-v1"


def _raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def peer_id_bytes(key: Ed25519PrivateKey) -> bytes:
    """The libp2p peer id of an Ed25519 key: identity multihash of the protobuf-encoded public key."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=_raw_public(key)).SerializeToString()
    return bytes([_IDENTITY_MULTIHASH, len(encoded)]) + encoded


def public_key_of(peer_id: str) -> Ed25519PublicKey | None:
    """The Ed25519 key a base58 peer id embeds; None for anything else (garbage, RSA ids, other key types)."""
    try:
        raw = base58.b58decode(peer_id)
        if len(raw) < 2 or raw[0] != _IDENTITY_MULTIHASH or raw[1] != len(raw) - 2:
            return None
        key = crypto_pb2.PublicKey.FromString(raw[2:])
        if key.key_type != crypto_pb2.Ed25519 or len(key.data) != 32:
            return None
        return Ed25519PublicKey.from_public_bytes(key.data)
    except Exception as e:  # noqa: BLE001 - peer ids come from the network; whatever fails to parse is no owner
        logger.debug("Not an Ed25519 peer id %r: %s", peer_id, e)
        return None


def write_p2pd_identity(key: Ed25519PrivateKey, path: Path) -> None:
    """Write `key` in the format p2pd's -id flag reads: a libp2p protobuf PrivateKey holding seed || public key."""
    seed = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    encoded = crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=seed + _raw_public(key)).SerializeToString()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(encoded)


def temporary_identity_file(key: Ed25519PrivateKey) -> Path:
    """A private folder holding `key` for p2pd to read at start; the caller removes it once the daemon runs."""
    folder = Path(tempfile.mkdtemp(prefix="swarmlm-identity-"))
    write_p2pd_identity(key, folder / "identity.key")
    return folder / "identity.key"


class PeerIdSignatureValidator(RecordValidatorBase):
    """Signs this node's records and accepts only records signed by the peer id in their subkey (see module doc)."""

    def __init__(self, key: Ed25519PrivateKey):
        # kept as raw bytes: the validator is copied into the DHT's child process
        self._seed = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        self.peer_id = base58.b58encode(peer_id_bytes(key)).decode()

    def validate(self, record: DHTRecord) -> bool:
        try:
            owner = MSGPackSerializer.loads(record.subkey)
            if not isinstance(owner, str):
                logger.debug("Rejecting a DHT record whose subkey is %r, not a peer id", type(owner).__name__)
                return False
            public_key = public_key_of(owner)
            value, signature = _split(record.value)
            if public_key is None or signature is None:
                logger.debug("Rejecting an unsigned record or one not owned by an Ed25519 peer id (%r)", owner[:60])
                return False
            public_key.verify(signature, _signed_bytes(dataclasses.replace(record, value=value)))
            return True
        except InvalidSignature:
            logger.debug("Rejecting a DHT record with a bad signature for subkey %r", record.subkey[:60])
            return False
        except Exception as e:  # noqa: BLE001 - records come from the network: anything unreadable is invalid
            logger.debug("Rejecting an unreadable DHT record: %s", e)
            return False

    def sign_value(self, record: DHTRecord) -> bytes:
        try:
            owner = MSGPackSerializer.loads(record.subkey)
        except Exception:  # noqa: BLE001 - not ours to sign; validation will reject it
            return record.value
        if owner != self.peer_id:
            return record.value  # only this node's own entry can be signed; others' will fail validation
        signature = Ed25519PrivateKey.from_private_bytes(self._seed).sign(_signed_bytes(record))
        return record.value + SIGNATURE_MARK + signature

    def strip_value(self, record: DHTRecord) -> bytes:
        return _split(record.value)[0]

    @property
    def priority(self) -> int:
        # like hivemind's signature validator: checked before any validator that would parse the value
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PeerIdSignatureValidator)


def _split(value: bytes) -> tuple[bytes, bytes | None]:
    """(value without signature, signature or None if the value carries none)."""
    tail = len(SIGNATURE_MARK) + _SIGNATURE_BYTES
    if len(value) >= tail and value[-tail:-_SIGNATURE_BYTES] == SIGNATURE_MARK:
        return value[:-tail], value[-_SIGNATURE_BYTES:]
    return value, None


def _signed_bytes(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps([_SIGNED_CONTEXT, record.key, record.subkey, record.value, record.expiration_time])
