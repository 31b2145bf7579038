"""Persistent server identities: created once with mode 0600, read back as the same key, refused when unsafe."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from swarmlm.errors import SwarmError
from swarmlm.swarm.keyfile import load_or_create_identity, peer_id_of_file, read_identity


def test_a_missing_key_is_created_private_and_read_back_as_the_same_key(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "server.key"
    key = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_identity(path)
    assert again.private_bytes_raw() == key.private_bytes_raw()
    assert peer_id_of_file(path).startswith("12D3KooW")


def test_a_key_others_may_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "server.key"
    load_or_create_identity(path)
    path.chmod(0o644)
    with pytest.raises(SwarmError, match="chmod 600"):
        load_or_create_identity(path)


@pytest.mark.parametrize("content", [b"", b"not a key", b"\x08\x01\x12\x40" + b"\x00" * 64, b"x" * 10000])
def test_garbage_is_refused_with_a_clear_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "server.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(SwarmError, match="identity"):
        read_identity(path)
