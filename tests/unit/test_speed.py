"""server/speed.py: the announced speed is the median of warm rounds, kept per key in the cache folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmlm.server import speed


def timings(seconds: list[float]) -> Iterator[float]:
    yield from seconds


def test_one_slow_round_does_not_move_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speed, "MIN_ROUND_S", 0.01)
    # a warm-up, then five rounds of one call each (each call reaches MIN_ROUND_S); the third round is 100x slower,
    # as when a neighbour's load lands on it
    calls = timings([5.0, 0.02, 0.02, 2.0, 0.02, 0.02])
    rate = speed.median_rate(lambda: next(calls), work=10)
    assert rate == pytest.approx(10 / 0.02)


def test_short_calls_are_repeated_until_a_round_is_long_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speed, "MIN_ROUND_S", 0.01)
    count = [0]

    def run() -> float:
        count[0] += 1
        return 0.001

    assert speed.median_rate(run, work=2, rounds=3) == pytest.approx(2 / 0.001)
    assert count[0] == 1 + 3 * 10  # the warm-up, then ten calls a round


def test_a_kept_speed_is_reused_until_measured_again(tmp_path: Path) -> None:
    measured = iter([(100.0, 10.0), (200.0, 20.0)])
    first = speed.known_speed(tmp_path, "key", lambda: next(measured))
    assert (first.forward, first.inference, first.source) == (100.0, 10.0, speed.MEASURED_NOW)
    kept = speed.known_speed(tmp_path, "key", lambda: pytest.fail("measured although a figure is kept"))
    assert (kept.forward, kept.inference, kept.source) == (100.0, 10.0, speed.MEASURED_BEFORE)
    assert kept.measured_at == first.measured_at
    again = speed.known_speed(tmp_path, "key", lambda: next(measured), remeasure=True)
    assert (again.forward, again.source) == (200.0, speed.MEASURED_NOW)
    assert speed.known_speed(tmp_path, "key", lambda: (0.0, 0.0)).forward == 200.0
    other = speed.known_speed(tmp_path, "other key", lambda: (7.0, 0.7))
    assert other.source == speed.MEASURED_NOW and len(json.loads((tmp_path / speed.SPEED_FILE).read_text())) == 2


def test_a_broken_file_is_measured_around(tmp_path: Path) -> None:
    (tmp_path / speed.SPEED_FILE).write_text('{"key": {"forward": "fast"}, "ok": [1]')
    assert speed.known_speed(tmp_path, "key", lambda: (3.0, 0.3)).source == speed.MEASURED_NOW
    (tmp_path / speed.SPEED_FILE).write_text(json.dumps({"key": {"forward": -1, "inference": 1, "measured_at": 1}}))
    assert speed.known_speed(tmp_path, "key", lambda: (4.0, 0.4)).forward == 4.0


def test_the_key_names_model_dtype_and_threads() -> None:
    key = json.loads(speed.speed_key("abc", "bfloat16", "cpu"))
    assert key[:2] == ["abc", "bfloat16"] and isinstance(key[2], str) and key[2] and isinstance(key[3], int)
