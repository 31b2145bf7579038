"""Why p2pd did not start, read from the last line hivemind reports: a bootstrap failure is tried again (and ends
as UnreachablePeersError), anything else is reported at once in p2pd's words."""

from __future__ import annotations

from swarmlm.swarm.dht import bootstrap_failed

PEERS = ["/ip4/127.0.0.1/tcp/41234/p2p/12D3KooWJ9wN5qumX8CfkADyodbeExxw2aS9CjTmDewz8Sd6vdFa"]
# p2pd's last line on a loaded machine, printed by another goroutine after its fatal bootstrap error
LOG_LINE = (
    '{"level":"info","ts":"2026-12-03T23:40:04.726Z","logger":"dht/RtRefreshManager","caller":'
    '"rtrefresh/rt_refresh_manager.go:322","msg":"starting refreshing cpl 0 with key CIQAAAJ3EE (routing table '
    'size was 0)"}'
)


def test_the_bootstrap_failure_is_recognized_with_or_without_peers() -> None:
    assert bootstrap_failed("failed to connect to bootstrap peers", PEERS)
    assert bootstrap_failed("failed to connect to bootstrap peers", [])


def test_a_log_line_hiding_the_fatal_one_is_a_bootstrap_failure_only_with_peers_to_join() -> None:
    assert bootstrap_failed(LOG_LINE, PEERS)
    assert not bootstrap_failed(LOG_LINE, [])  # nothing to bootstrap from: some other failure, reported as it is


def test_other_fatal_errors_are_not_taken_for_a_bootstrap_failure() -> None:
    taken = "failed to listen on any addresses: [listen tcp4 127.0.0.1:31337: bind: address already in use]"
    assert not bootstrap_failed(taken, PEERS)
    assert not bootstrap_failed("", PEERS)
