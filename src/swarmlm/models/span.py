"""A contiguous span of decoder blocks, run exactly as the local Hugging Face model runs them."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import Cache, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from swarmlm.errors import ModelLoadError
from swarmlm.models.loading import load_config, load_tensors
from swarmlm.models.lora import lora_applied
from swarmlm.models.registry import FULL_ATTENTION, SLIDING_ATTENTION, ModelFamily, get_family
from swarmlm.protocol.lora import LoraWeights

# how Hugging Face builds the mask of each attention kind (a sliding window reads config.sliding_window)
_MASK_BUILDERS = {FULL_ATTENTION: create_causal_mask, SLIDING_ATTENTION: create_sliding_window_causal_mask}


class SpanModel(nn.Module):
    """Blocks [start, end) of a decoder, with the rotary embedding they need; holds no other weights."""

    def __init__(self, config: PretrainedConfig, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"span {start}:{end} is outside the model's {config.num_hidden_layers} blocks")
        self.config, self.start, self.end = config, start, end
        self.family: ModelFamily = get_family(config)
        # layers keep their global index: caches and masks are addressed by it
        self.layers = nn.ModuleList(self.family.block_class(config, layer_idx=i) for i in range(start, end))
        self.rotary = self.family.rotary_class(config)
        self.layer_kinds = self.family.layer_kinds(config)  # by global layer index: which mask and rotary each gets
        self.adapters: tuple[str, ...] = ()  # LoRA adapters loaded into the blocks (models/adapters.py)
        self.active_adapter: str | None = None  # the one the blocks apply now (None: the base model)

    @classmethod
    def from_dir(
        cls, model_dir: Path, start: int, end: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> SpanModel:
        """Build the span and read only its own blocks' tensors from disk."""
        config = load_config(model_dir)
        with torch.device("meta"):
            span = cls(config, start, end)
        prefixes = [span.family.block_tensor_prefix(i) for i in range(start, end)]
        tensors = load_tensors(model_dir, prefixes, dtype=dtype)
        by_block: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            number, rest = name[len(span.family.block_prefix) :].split(".", 1)
            by_block.setdefault(int(number) - start, {})[rest] = tensor
        state = {}
        for index, block_tensors in by_block.items():
            # the family maps the block's stored layout to its module's (e.g. Mixtral's experts, fused on load)
            for rest, tensor in span.family.block_state(config, block_tensors).items():
                state[f"layers.{index}.{rest}"] = tensor
        missing, unexpected = span.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ModelLoadError(
                f"{model_dir}: blocks {start}:{end} miss tensors {missing[:5]}, have unexpected {unexpected[:5]}"
            )
        # rotary frequencies are not in checkpoints: rebuild them off the meta device, kept in float32 for precision
        span.rotary = span.family.rotary_class(config).to(device)
        span.layers.to(device=device, dtype=dtype)
        if torch.device(device).type == "cpu" and dtype == torch.float32:
            column_major_linears(span.layers)
        # weights are frozen: backward computes gradients wrt inputs and prompts only
        return span.requires_grad_(False).eval()

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        start: int | None = None,
        end: int | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
        lora: LoraWeights | None = None,
    ) -> torch.Tensor:
        """Run blocks [start, end) (default: the whole span) over hidden (batch, seq, hidden).

        attention_mask (batch, past + seq) and position_ids (batch, seq) follow the Hugging Face conventions;
        position_ids default to past + arange(seq), like the local model. prompts (end - start, prefix, hidden) or
        (end - start, batch, prefix, hidden), if given, are deep prompts: prompts[i] is added to the first `prefix`
        positions of block start+i's input (with a cache, to those of this call's tokens whose positions past + j
        fall inside the prefix). adapter names a loaded LoRA adapter to apply (None: the base model); lora, the
        request's own LoRA weights of (at least) blocks [start, end), applied for this call only.
        """
        self.use_adapter(adapter)
        start = self.start if start is None else start
        end = self.end if end is None else end
        past = cache.get_seq_length(start) if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + past).unsqueeze(0)
        kinds = self.layer_kinds[start:end]
        masks, rotaries = {}, {}
        for kind in dict.fromkeys(kinds):  # each kind once, in order
            masks[kind] = _MASK_BUILDERS[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
                layer_idx=start + kinds.index(kind),
            )
            rotaries[kind] = self.family.position_embeddings(self.rotary, hidden, position_ids, kind)
        for index, layer in enumerate(self.layers[start - self.start : end - self.start]):
            if prompts is not None:
                hidden = add_prompt(hidden, prompts[index], past)
            with lora_applied(layer, lora, start + index):
                hidden = layer(
                    hidden,
                    attention_mask=masks[kinds[index]],
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=cache is not None,
                    position_embeddings=rotaries[kinds[index]],
                )
        return hidden

    def use_adapter(self, adapter: str | None) -> None:
        """Apply `adapter` (None: none) in the computations that follow."""
        if adapter != self.active_adapter:
            from swarmlm.models.adapters import select_adapter

            select_adapter(self, adapter)


def column_major_linears(module: nn.Module) -> None:
    """Store every nn.Linear weight inside `module` column-major, in place.

    The weight stays an (out, in) tensor to every reader (LoRA, quantization, state dicts); only its memory is the
    transpose's. A Linear computes x @ weight.T, and CPU BLAS (MKL) multiplies a few rows (a batch of decode steps)
    by a row-major (in, out) matrix faster than by a transposed one, and as fast for one row or thousands
    (`python bench/decode_batch.py --row-major` shows the difference).
    """
    for child in module.modules():
        if type(child) is nn.Linear and child.weight.is_contiguous():
            child.weight = nn.Parameter(child.weight.detach().t().contiguous().t(), requires_grad=False)


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor, past: int = 0) -> torch.Tensor:
    """hidden (batch, seq, hidden), the tokens after `past` earlier ones, with prompt (prefix, hidden) -- or per
    sample (batch, prefix, hidden) -- added where their positions fall inside the prefix; out of place (autograd
    needs the original)."""
    overlap = max(0, min(prompt.shape[-2] - past, hidden.shape[1]))
    if overlap == 0:
        return hidden
    added = prompt[..., past : past + overlap, :].to(hidden.dtype)
    return torch.cat([hidden[:, :overlap] + added, hidden[:, overlap:]], dim=1)
