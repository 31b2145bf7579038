"""Unit tests of record signatures: only the key embedded in a subkey's peer id may write that entry."""

import dataclasses

import base58
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from swarmlm.swarm.identity import PeerIdSignatureValidator, peer_id_bytes, public_key_of

KEY = b"\x01" * 20  # DHT keys are hashes; any bytes do


def _record(owner: object, value: object = None, expiration: float = 100.0) -> DHTRecord:
    value = {"state": "online"} if value is None else value
    return DHTRecord(KEY, MSGPackSerializer.dumps(owner), MSGPackSerializer.dumps(value), expiration)


def test_own_record_is_signed_and_accepted_by_anyone() -> None:
    server, other = (
        PeerIdSignatureValidator(Ed25519PrivateKey.generate()),
        PeerIdSignatureValidator(Ed25519PrivateKey.generate()),
    )
    assert server.peer_id.startswith("12D3KooW")
    record = _record(server.peer_id)
    signed = dataclasses.replace(record, value=server.sign_value(record))
    assert other.validate(signed) and server.validate(signed)
    assert other.strip_value(signed) == record.value


def test_others_entries_cannot_be_written() -> None:
    victim, attacker = (
        PeerIdSignatureValidator(Ed25519PrivateKey.generate()),
        PeerIdSignatureValidator(Ed25519PrivateKey.generate()),
    )
    forged = _record(victim.peer_id, {"state": "offline"})
    # the attacker's node refuses to sign another's entry, and an unsigned value is rejected
    assert attacker.sign_value(forged) == forged.value
    assert not victim.validate(forged) and not attacker.validate(forged)
    # a signature by the attacker's own key, pasted onto the victim's entry, does not verify
    own = _record(attacker.peer_id, {"state": "offline"})
    stolen_signature = attacker.sign_value(own)[len(own.value) :]
    assert not victim.validate(dataclasses.replace(forged, value=forged.value + stolen_signature))


def test_signed_records_cannot_be_altered_or_redated() -> None:
    server = PeerIdSignatureValidator(Ed25519PrivateKey.generate())
    record = _record(server.peer_id)
    signed = dataclasses.replace(record, value=server.sign_value(record))
    assert not server.validate(dataclasses.replace(signed, expiration_time=1e12))
    assert not server.validate(dataclasses.replace(signed, key=b"\x02" * 20))
    tampered = MSGPackSerializer.dumps({"state": "offline"}) + signed.value[len(record.value) :]
    assert not server.validate(dataclasses.replace(signed, value=tampered))


def test_garbage_is_rejected_without_raising() -> None:
    server = PeerIdSignatureValidator(Ed25519PrivateKey.generate())
    rsa_like = base58.b58encode(b"\x12\x20" + b"\x00" * 32).decode()  # a sha256 multihash id ("Qm..."): no key in it
    for owner in [None, 42, "", "not-base58-0OIl", rsa_like, "12D3KooW" + "x" * 40]:
        record = _record(owner)
        assert not server.validate(dataclasses.replace(record, value=server.sign_value(record)))
    assert not server.validate(DHTRecord(KEY, b"\xc1garbage", b"\xff" * 100, 1.0))
    assert public_key_of("Qm" + "1" * 44) is None


def test_peer_id_embeds_the_public_key() -> None:
    key = Ed25519PrivateKey.generate()
    peer_id = base58.b58encode(peer_id_bytes(key)).decode()
    assert public_key_of(peer_id).public_bytes_raw() == key.public_key().public_bytes_raw()
