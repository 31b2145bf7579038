"""The API's /metrics text: Prometheus' exposition format 0.0.4 (HELP and TYPE lines, counters, cumulative buckets)."""

from __future__ import annotations

from swarmlm.api.metrics import ApiMetrics
from swarmlm.models import loading
from swarmlm.models.constants import KNOWN_MODELS


def test_counters_and_histograms_render_in_prometheus_text_format() -> None:
    metrics = ApiMetrics()
    metrics.finished("ok", prompt_tokens=10, new_tokens=5, ttft_s=0.3, duration_s=1.1)
    metrics.finished("MissingBlocksError", prompt_tokens=4, new_tokens=0, ttft_s=None, duration_s=10.0)
    metrics.error("missing_blocks")
    metrics.error('odd"kind')
    text = metrics.render({"requests_running": ("help", 2)})
    lines = text.splitlines()
    assert text.endswith("\n")
    assert 'swarmlm_requests_total{outcome="ok"} 1' in lines
    assert 'swarmlm_requests_total{outcome="MissingBlocksError"} 1' in lines
    assert 'swarmlm_errors_total{kind="odd\\"kind"} 1' in lines  # label values are escaped
    assert "swarmlm_prompt_tokens_total 14" in lines and "swarmlm_generation_tokens_total 5" in lines
    assert "# TYPE swarmlm_time_to_first_token_seconds histogram" in lines
    assert 'swarmlm_time_to_first_token_seconds_bucket{le="0.25"} 0' in lines
    assert 'swarmlm_time_to_first_token_seconds_bucket{le="0.5"} 1' in lines  # cumulative from here on
    assert 'swarmlm_time_to_first_token_seconds_bucket{le="+Inf"} 1' in lines
    assert "swarmlm_time_to_first_token_seconds_count 1" in lines
    assert "swarmlm_request_duration_seconds_count 2" in lines and "swarmlm_request_duration_seconds_sum 11.1" in lines
    assert "swarmlm_time_per_output_token_seconds_sum 0.2" in lines  # (1.1 - 0.3) / 4 tokens after the first
    assert "# TYPE swarmlm_requests_running gauge" in lines and "swarmlm_requests_running 2" in lines
    for line in lines:  # every sample's family was declared before it
        if not line.startswith("#"):
            family = line.split("{")[0].split(" ")[0]
            base = family.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
            assert f"# TYPE {family} " in text or f"# TYPE {base} histogram" in text, line


def test_the_command_line_knows_the_loaders_model_names() -> None:
    assert set(KNOWN_MODELS) == set(loading._KNOWN_MODELS)
