"""swarmlm.AutoTokenizer: the tokenizer of any model `from_pretrained` accepts (a Hub model's small files only)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from swarmlm.models.loading import load_tokenizer, resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class AutoTokenizer:
    """Like transformers' AutoTokenizer, for the model names swarmlm resolves: a Hub repository, the bundled name
    ("smollm2-135m-instruct"), a .gguf file or a local Hugging Face folder.

    transformers' own AutoTokenizer takes "smollm2-135m-instruct" for a Hub repository and tries the network;
    this one resolves the name as `AutoDistributedModelForCausalLM.from_pretrained` does (converting a GGUF file
    once, under the same cache folder) and reads the tokenizer saved with the model, offline.
    """

    @staticmethod
    def from_pretrained(
        model: str | os.PathLike,
        *,
        cache_dir: str | os.PathLike | None = None,
        revision: str | None = None,
        **options: Any,
    ) -> PreTrainedTokenizerBase:
        """The tokenizer of `model` (with its chat template, if it has one); a Hub model's at `revision`. `options`
        go to transformers' AutoTokenizer.from_pretrained (e.g. padding_side="left" for batches of prompts)."""
        return load_tokenizer(resolve_model(model, cache_dir=cache_dir, revision=revision), **options)
