"""The data of the project's own lm-eval tasks, read from the JSON lines beside this file (no download)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def _split(name: str) -> dict[str, datasets.Dataset]:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def facts(**kwargs: Any) -> dict[str, datasets.Dataset]:
    return _split("facts.jsonl")


def answers(**kwargs: Any) -> dict[str, datasets.Dataset]:
    return _split("answers.jsonl")
