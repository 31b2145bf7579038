"""The API's numbers in Prometheus' text exposition format (0.0.4), served at GET /metrics for a scraper.

Counters and histograms are kept here, fed by the engine as requests finish and by the HTTP layer as it answers
errors; gauges are read when scraped. Everything runs on the HTTP server's event loop, so nothing is locked.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "swarmlm_"
# bucket bounds in seconds, from a fast local answer to a slow swarm across continents
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS_S = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    """Cumulative-bucket histogram: counts per upper bound (the last one +Inf), and the sum of observations."""

    bounds: Sequence[float]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        lines, running = [], 0
        for bound, count in zip([*self.bounds, math.inf], self.counts, strict=True):
            running += count
            lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        return [*lines, f"{name}_sum {_number(self.total)}", f"{name}_count {running}"]


class ApiMetrics:
    """What GET /metrics reports about one API server since it started."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()  # finished generations by outcome ("ok", "cancelled", error class)
        self.errors: Counter[str] = Counter()  # error replies by kind (their OpenAI code, else their type)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.time_to_first_token = Histogram(TTFT_BUCKETS_S)
        self.request_duration = Histogram(REQUEST_BUCKETS_S)
        self.time_per_output_token = Histogram(PER_TOKEN_BUCKETS_S)

    def finished(
        self, outcome: str, prompt_tokens: int, new_tokens: int, ttft_s: float | None, duration_s: float
    ) -> None:
        """A generation ended (answered, cancelled or failed)."""
        self.requests[outcome] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += new_tokens
        self.request_duration.observe(duration_s)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
            if new_tokens > 1:  # the first token's time is the prefill's, counted above
                self.time_per_output_token.observe((duration_s - ttft_s) / (new_tokens - 1))

    def error(self, kind: str) -> None:
        self.errors[kind] += 1

    def render(self, gauges: Mapping[str, tuple[str, float]] | None = None) -> str:
        """The exposition text; `gauges` adds current values (name without prefix -> help, value)."""
        out: list[str] = []
        family(out, "requests_total", "counter", "generations finished, by outcome (ok, cancelled, or the error)",
               [(f'{{outcome="{_label(k)}"}}', v) for k, v in sorted(self.requests.items())])  # fmt: skip
        family(out, "errors_total", "counter", "error replies, by kind (OpenAI code or type)",
               [(f'{{kind="{_label(k)}"}}', v) for k, v in sorted(self.errors.items())])  # fmt: skip
        family(
            out, "prompt_tokens_total", "counter", "prompt tokens of finished generations", [("", self.prompt_tokens)]
        )
        family(out, "generation_tokens_total", "counter", "tokens generated", [("", self.generation_tokens)])
        for name, help_text, histogram in (
            ("time_to_first_token_seconds", "time from a request to its first token", self.time_to_first_token),
            ("request_duration_seconds", "time from a request to its last token", self.request_duration),
            ("time_per_output_token_seconds", "time per token after the first", self.time_per_output_token),
        ):
            out += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} histogram"]
            out += histogram.lines(PREFIX + name)
        for name, (help_text, value) in (gauges or {}).items():
            family(out, name, "gauge", help_text, [("", value)])
        return "\n".join(out) + "\n"


def family(out: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
    """Append one metric family: HELP, TYPE and its samples (labels already formatted, e.g. '{kind="x"}')."""
    out += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
    out += [f"{PREFIX}{name}{labels} {_number(value)}" for labels, value in samples]


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _label(value: str) -> str:
    # the format escapes backslash, double quote and newline in label values
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
