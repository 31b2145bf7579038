"""What a server of a Hub model downloads and holds: a server of 2 of N blocks against one of all N blocks.

Makes a random Llama checkpoint of at least 1 GB (bfloat16, sharded as checkpoints on the Hub are) in a temporary
folder, serves it from a local Hub-compatible endpoint (tests/hub.py) and starts `swarmlm serve org/bench --blocks`
for 2 blocks and for all blocks, each with a fresh Hub cache. For each it prints the bytes the endpoint sent, the
bytes its cache holds, the weights of its blocks, and the resident memory (RSS) of its process once it serves,
whose excess over the weights is the process's fixed cost (Python, torch, hivemind) plus its KV cache.

    python bench/hub_memory.py [--layers 10] [--hidden 2048] [--cache-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmlm.tools.local_swarm import LocalSwarm  # noqa: E402
from tests.hub import LocalHub  # noqa: E402

REPO = "org/bench"
SHARD_BYTES = 200 * 2**20  # as the Hub's usual 5 GB shards, scaled to the checkpoint: several blocks per shard
VOCAB = 32000
# the server's RSS is read this long after it is ready, so that its start-up measurements have finished
SETTLE_S = 3.0


def block_tensors(index: int, hidden: int, intermediate: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}."
    shapes = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    return {prefix + name: (torch.randn(shape) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}


def make_checkpoint(folder: Path, layers: int, hidden: int, intermediate: int) -> dict[str, int]:
    """Writes the checkpoint; returns the bytes of each block's tensors ("block.i") and of the client's parts."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
        "num_key_value_heads": hidden // 128, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    groups: list[dict[str, torch.Tensor]] = [
        {"model.embed_tokens.weight": (torch.randn(VOCAB, hidden) * 0.02).to(torch.bfloat16)}
    ]
    groups += [block_tensors(i, hidden, intermediate) for i in range(layers)]
    groups.append(
        {
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "lm_head.weight": (torch.randn(VOCAB, hidden) * 0.02).to(torch.bfloat16),
        }
    )
    sizes = {f"block.{i}": sum(t.numel() * 2 for t in groups[i + 1].values()) for i in range(layers)}
    sizes["client"] = sum(t.numel() * 2 for group in (groups[0], groups[-1]) for t in group.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    for group in groups:  # greedy, as transformers shards: a block may straddle two shards
        for name, tensor in group.items():
            if shards[-1] and sum(t.numel() * 2 for t in shards[-1].values()) + tensor.numel() * 2 > SHARD_BYTES:
                shards.append({})
            shards[-1][name] = tensor
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(sizes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sizes


def serve_and_measure(hub: LocalHub, cache: Path, start: int, end: int, cache_tokens: int) -> tuple[int, int, int]:
    """(bytes sent by the Hub, bytes in the server's Hub cache, RSS of the serving process)."""
    os.environ["HF_HUB_CACHE"] = str(cache)
    hub.clear()
    with LocalSwarm(REPO, threads_per_server=2) as swarm:
        server = swarm.add_server(start, end, extra_args=["--dtype", "auto", "--cache-tokens", str(cache_tokens)])
        time.sleep(SETTLE_S)
        rss = psutil.Process(server.process.pid).memory_info().rss
    sent = sum(f.sent for f in hub.fetched if f.method == "GET" and f.status in (200, 206))
    held = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file() and not f.is_symlink())
    return sent, held, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--cache-tokens", type=int, default=256, help="the servers' KV-cache budget")
    args = parser.parse_args()
    os.environ.pop("SWARMLM_PREFORK", None)  # the RSS of a process of its own, not of a fork sharing pages
    os.environ.pop("HF_HUB_OFFLINE", None)
    work = Path(tempfile.mkdtemp(prefix="swarmlm-hub-bench-"))
    try:
        checkpoint = work / "checkpoint"
        checkpoint.mkdir()
        sizes = make_checkpoint(checkpoint, args.layers, args.hidden, args.intermediate)
        repo_bytes = sum(f.stat().st_size for f in checkpoint.iterdir())
        shards = len(list(checkpoint.glob("*.safetensors")))
        block_mb, client_mb = sizes["block.0"] / 1e6, sizes["client"] / 1e6
        print(f"checkpoint: {repo_bytes / 1e9:.2f} GB in {shards} shards, {args.layers} blocks of {block_mb:.0f} MB, "
              f"embeddings + head {client_mb:.0f} MB (bfloat16)")  # fmt: skip
        with LocalHub() as hub:
            hub.add_repo(REPO, checkpoint)
            os.environ["HF_ENDPOINT"] = hub.endpoint
            for start, end in ((0, 2), (0, args.layers)):
                weights = sum(sizes[f"block.{i}"] for i in range(start, end))
                sent, held, rss = serve_and_measure(hub, work / f"cache-{start}-{end}", start, end, args.cache_tokens)
                print(f"blocks {start}:{end}: downloaded {sent / 1e6:.0f} MB, cache holds {held / 1e6:.0f} MB, "
                      f"its blocks' weights {weights / 1e6:.0f} MB, RSS {rss / 1e6:.0f} MB "
                      f"(RSS - weights = {(rss - weights) / 1e6:.0f} MB)")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
