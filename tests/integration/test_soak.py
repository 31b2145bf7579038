"""A short soak: servers crash, join and drain while clients generate and one trains; every token equals a local
run's, no call fails while the live servers cover every block, and nothing the soak started is left running."""

from __future__ import annotations

from pathlib import Path

from swarmlm.tools.soak import SoakPlan, run_soak
from tests.conftest import descendants


def test_a_short_soak_serves_every_token_right_and_loses_no_session(tiny_model_dir: Path) -> None:
    before = {process.pid for process in descendants()}
    # four events: a crash, a join, a drain and a join (the hour-long soak is bench/soak.py)
    plan = SoakPlan(minutes=0.6, clients=3, event_interval_s=8.0, sample_interval_s=2.0, seed=1)
    report = run_soak(tiny_model_dir, plan)
    tally = report.tally
    assert tally.calls > 0 and tally.tokens > 0 and tally.train_steps > 0
    assert tally.wrong_tokens == 0
    assert tally.lost == []
    assert {event for _, event, _ in report.events} == {"crash", "join", "drain"}
    assert report.samples and all(s.rss_mb > 0 and s.fds > 0 for s in report.samples)
    assert {g.server for g in report.growth} <= {s.server for s in report.samples}
    assert report.left_running == []
    assert {process.pid for process in descendants()} == before
