"""A node's persistent Ed25519 identity on disk (`swarmlm serve --identity PATH`): same key, same peer id.

The file holds the key in the format p2pd reads (a libp2p protobuf PrivateKey: seed || public key), is created
with mode 0600 when missing, and is refused when others may read it or when it holds anything but an Ed25519 key.
"""

from __future__ import annotations

from pathlib import Path

import base58
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from google.protobuf.message import DecodeError
from hivemind.proto import crypto_pb2

from swarmlm.checks import check_private_file
from swarmlm.errors import SwarmError
from swarmlm.swarm.identity import peer_id_bytes, write_p2pd_identity

# an Ed25519 private key in libp2p's encoding: 32 bytes of seed followed by the 32-byte public key
_SEED_BYTES, _PUBLIC_BYTES = 32, 32
# a key file is a few dozen bytes; anything much larger is not one
MAX_KEY_FILE_BYTES = 4096


def load_or_create_identity(path: str | Path) -> Ed25519PrivateKey:
    """The key stored at `path`, or a new one written there (mode 0600, parent folders created) if none is."""
    path = Path(path).expanduser()
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            key = Ed25519PrivateKey.generate()
            try:
                write_p2pd_identity(key, path)
            except FileExistsError:  # another process created it meanwhile: use that one
                return read_identity(path)
            return key
        return read_identity(path)
    except OSError as e:  # a folder in the way, no permission, a full disk
        raise SwarmError(f"identity {path}: cannot read or create it: {e.strerror or e}") from e


def read_identity(path: Path) -> Ed25519PrivateKey:
    check_private_file(path, "identity")
    data = path.read_bytes()[: MAX_KEY_FILE_BYTES + 1]
    try:
        if len(data) > MAX_KEY_FILE_BYTES:
            raise ValueError("file too large")
        message = crypto_pb2.PrivateKey.FromString(data)
        if message.key_type != crypto_pb2.Ed25519 or len(message.data) != _SEED_BYTES + _PUBLIC_BYTES:
            raise ValueError("not an Ed25519 key")
        key = Ed25519PrivateKey.from_private_bytes(message.data[:_SEED_BYTES])
    except (DecodeError, ValueError) as e:
        raise SwarmError(f"identity {path} is not an Ed25519 key file written by swarmlm: {e}") from e
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    if public != message.data[_SEED_BYTES:]:
        raise SwarmError(f"identity {path} is corrupt: its public key does not match its private key")
    return key


def peer_id_of_file(path: str | Path) -> str:
    """The base58 peer id the key at `path` gives a node (without creating anything)."""
    return base58.b58encode(peer_id_bytes(read_identity(Path(path)))).decode()
