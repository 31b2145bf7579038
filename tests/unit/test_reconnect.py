"""Which peers a node dials again (swarm/reconnect.py): its initial peers always, the peers it met for a while."""

from __future__ import annotations

from pathlib import Path

from swarmlm.swarm.reconnect import PeerBook, load_peers, peers_file, peers_of, save_peers

A = "12D3KooWBHn64dPUMLu91KMRXYR3f6LsmdgHGxERxrxJzA6kfLTS"
B = "12D3KooWJp8KBNwPtnrSrWmHuqbXxFnZ7L8QdYoDaQuj5dQbHumw"
ME = "12D3KooWDi872eYrdXwAJv4cdPucc4afhHz3FsYCMV8puWSsJRuP"


def test_initial_peers_are_grouped_by_peer_with_their_addresses() -> None:
    maddrs = [f"/ip4/10.0.0.1/tcp/31337/p2p/{A}", f"/ip6/::1/tcp/31337/p2p/{A}", f"/ip4/10.0.0.2/tcp/1/p2p/{B}"]
    assert peers_of(maddrs) == {A: ("/ip4/10.0.0.1/tcp/31337", "/ip6/::1/tcp/31337"), B: ("/ip4/10.0.0.2/tcp/1",)}


def test_missing_initial_peers_are_dialled_and_present_ones_and_the_node_itself_are_not() -> None:
    book = PeerBook(peers_of([f"/ip4/10.0.0.1/tcp/1/p2p/{A}", f"/ip4/10.0.0.2/tcp/2/p2p/{ME}"]))
    assert book.missing(present=set(), own=ME) == {A: ("/ip4/10.0.0.1/tcp/1",)}
    assert book.missing(present={A}, own=ME) == {}


def test_met_peers_are_dialled_at_their_last_known_addresses_once_missing() -> None:
    book = PeerBook({})
    book.note({B: ("/ip4/10.0.0.2/tcp/2",)}, now=0.0)
    book.note({B: ()}, now=5.0)  # in the table, but not connected now: the addresses known stay
    assert book.missing(present={B}, own=ME) == {}
    assert book.missing(present=set(), own=ME) == {B: ("/ip4/10.0.0.2/tcp/2",)}


def test_a_met_peer_absent_too_long_is_forgotten_an_initial_one_never() -> None:
    book = PeerBook(peers_of([f"/ip4/10.0.0.1/tcp/1/p2p/{A}"]), forget_after_s=60.0)
    book.note({A: ("/ip4/10.0.0.9/tcp/9",), B: ("/ip4/10.0.0.2/tcp/2",)}, now=0.0)
    book.note({}, now=30.0)
    assert set(book.missing(present=set(), own=ME)) == {A, B}
    book.note({}, now=61.0)
    # the initial peer keeps the address the operator gave, not one it was seen connected at
    assert book.missing(present=set(), own=ME) == {A: ("/ip4/10.0.0.1/tcp/1",)}


def test_met_peers_are_bounded_and_the_longest_absent_go_first() -> None:
    book = PeerBook({}, capacity=2)
    for second, peer in enumerate(["p1", "p2", "p3"]):
        book.note({peer: (f"/ip4/10.0.0.{second}/tcp/1",)}, now=float(second))
    book.note({"p2": ()}, now=3.0)  # present again: now the most recently seen
    book.note({"p4": ("/ip4/10.0.0.4/tcp/1",)}, now=4.0)
    assert set(book.missing(present=set(), own=ME)) == {"p2", "p4"}


def test_the_peers_file_keeps_met_peers_beside_the_key_file_and_junk_is_ignored(tmp_path: Path) -> None:
    path = peers_file(tmp_path / "a.key")
    assert path == tmp_path / "a.key.peers.json"
    assert load_peers(path) == {}  # no file yet: nothing remembered
    save_peers(path, {B: ("/ip4/10.0.0.2/tcp/2",)})
    assert load_peers(path) == {B: ("/ip4/10.0.0.2/tcp/2",)}
    for junk in ("not json", "[1, 2]", '{"x": [1]}'):
        path.write_text(junk)
        assert load_peers(path) == {}
