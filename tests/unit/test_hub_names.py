"""Hub names and the Hub cache without a network: repository ids as users type them, snapshot folders, and the disk
budget's eviction on a cache laid out as huggingface_hub lays it out (blobs, snapshots of links)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarmlm.models.hub import HubName, evict, hub_origin, parse_hub_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", HubName("meta-llama/Llama-3.1-8B-Instruct")),
        ("Qwen/Qwen2.5-0.5B", HubName("Qwen/Qwen2.5-0.5B")),
        ("org/name/model.Q4_K_M.gguf", HubName("org/name", gguf_file="model.Q4_K_M.gguf")),
        ("org/name:Q4_K_M", HubName("org/name", gguf_quant="Q4_K_M")),
        ("smollm2-135m-instruct", None),
        ("./org/name", None),
        ("/abs/org/name", None),
        ("~/models/x", None),
        ("org/a/b", None),
        ("org/../etc", None),
        ("org/na--me", None),
        ("org/", None),
        ("model.gguf", None),
    ],
)
def test_repository_ids_as_typed(text: str, expected: HubName | None) -> None:
    assert parse_hub_name(text) == expected


def test_only_snapshot_folders_of_a_hub_cache_have_an_origin(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--org--name" / "snapshots" / COMMIT
    assert hub_origin(snapshot) == ("org/name", COMMIT)
    assert hub_origin(tmp_path / "models--org--name" / "snapshots" / "main") is None
    assert hub_origin(tmp_path / "org" / "snapshots" / COMMIT) is None
    assert hub_origin(tmp_path / "name") is None


def _cache(tmp_path: Path, files: dict[str, int], snapshots: tuple[str, ...] = (COMMIT,)) -> Path:
    """A Hub cache of org/name: each file a blob of its size (bytes), linked from every snapshot; file i was last
    used at time 1000 + i (older first)."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    for index, (name, size) in enumerate(files.items()):
        blob = repo / "blobs" / f"blob-{name}"
        blob.write_bytes(b"x" * size)
        os.utime(blob, (1000 + index, 1000 + index))
        for commit in snapshots:
            (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
            (repo / "snapshots" / commit / name).symlink_to(blob)
    return repo / "snapshots" / snapshots[0]


def test_eviction_deletes_unneeded_shards_least_recently_used_first(tmp_path: Path) -> None:
    folder = _cache(tmp_path, {"config.json": 10, "a.safetensors": 100, "b.safetensors": 100, "c.safetensors": 100})
    # 310 bytes held, 250 allowed: the oldest unneeded shard goes, and that is enough
    assert evict(folder, keep={"c.safetensors"}, max_bytes=250) == ["a.safetensors"]
    assert sorted(p.name for p in folder.iterdir()) == ["b.safetensors", "c.safetensors", "config.json"]
    assert not (folder.parent.parent / "blobs" / "blob-a.safetensors").exists()


def test_eviction_never_deletes_a_shard_in_use(tmp_path: Path) -> None:
    folder = _cache(tmp_path, {"a.safetensors": 100, "b.safetensors": 100})
    assert evict(folder, keep={"a.safetensors", "b.safetensors"}, max_bytes=1) == []
    assert evict(folder, keep={"b.safetensors"}, max_bytes=1) == ["a.safetensors"]
    assert (folder / "b.safetensors").read_bytes() == b"x" * 100


def test_a_blob_shared_with_another_snapshot_goes_with_all_its_links(tmp_path: Path) -> None:
    folder = _cache(tmp_path, {"a.safetensors": 100, "b.safetensors": 100}, snapshots=(COMMIT, OTHER))
    other = folder.parent / OTHER
    # a shard kept in this snapshot stays in the other one too: it is the same blob
    assert evict(folder, keep={"b.safetensors"}, max_bytes=0) == ["a.safetensors", "a.safetensors"]
    assert sorted(p.name for p in other.iterdir()) == ["b.safetensors"]


def test_folders_that_are_no_snapshot_are_never_touched(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    assert evict(tmp_path, keep=(), max_bytes=0) == []
    assert (tmp_path / "model.safetensors").exists()
