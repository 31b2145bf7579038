"""Unit tests of private swarms without sockets: key files, sealed records, blinded names and membership."""

import dataclasses
from pathlib import Path

import pytest
from hivemind.dht.validation import DHTRecord

from swarmlm.cli import main as cli
from swarmlm.errors import SwarmError
from swarmlm.server.membership import Members
from swarmlm.swarm.private import (
    SwarmKeyValidator,
    blind_prefix,
    generate_swarm_key,
    load_swarm_key,
    membership_token,
)

KEY, OTHER = bytes(range(32)), bytes(range(1, 33))
RECORD = DHTRecord(key=b"k" * 20, subkey=b"\xa3abc", value=b"a server's record", expiration_time=1e9)


def test_key_files_round_trip_and_bad_ones_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    assert cli.main(["swarm-key", str(path)]) == 0
    assert len(load_swarm_key(path)) == 32
    assert path.stat().st_mode & 0o077 == 0  # readable by its owner only
    assert cli.main(["swarm-key", str(path)]) == 2  # never overwrites a key
    bare = tmp_path / "bare.key"
    bare.write_text(KEY.hex() + "\n")
    assert load_swarm_key(bare) == KEY
    for text in ("", "/key/swarm/psk/1.0.0/\n/base16/\nzz\n", "ab" * 16):
        bare.write_text(text)
        with pytest.raises(SwarmError, match="not a swarm key"):
            load_swarm_key(bare)
    with pytest.raises(SwarmError, match="cannot read"):
        load_swarm_key(tmp_path / "missing.key")
    generate_swarm_key(tmp_path / "other.key")
    assert load_swarm_key(tmp_path / "other.key") != load_swarm_key(path)


def test_records_are_sealed_with_the_key_and_bound_to_their_place() -> None:
    mine = SwarmKeyValidator(KEY)
    sealed = dataclasses.replace(RECORD, value=mine.sign_value(RECORD))
    assert b"server" not in sealed.value
    assert mine.validate(sealed) and mine.strip_value(sealed) == RECORD.value
    assert not SwarmKeyValidator(OTHER).validate(sealed)  # another swarm cannot read it
    assert not mine.validate(RECORD)  # an outsider's plain record is refused
    flipped = sealed.value[:-1] + bytes([sealed.value[-1] ^ 1])
    assert not mine.validate(dataclasses.replace(sealed, value=flipped))
    for moved in (dict(subkey=b"\xa3xyz"), dict(expiration_time=2e9), dict(key=b"j" * 20)):
        assert not mine.validate(dataclasses.replace(sealed, **moved))  # not replayable elsewhere


def test_names_and_membership_tokens_need_the_key() -> None:
    assert blind_prefix("model", KEY) != blind_prefix("model", OTHER) != "model"
    assert blind_prefix("model", KEY).startswith("model.")
    members = Members(KEY, capacity=2)
    assert not members.join("peer-a", membership_token(OTHER, "peer-a"))
    assert not members.join("peer-a", membership_token(KEY, "peer-b"))  # a token is worthless to other peers
    assert not members.admits("peer-a")
    for peer in ("peer-a", "peer-b", "peer-c"):
        assert members.join(peer, membership_token(KEY, peer))
    assert not members.admits("peer-a") and members.admits("peer-b") and members.admits("peer-c")  # bounded
