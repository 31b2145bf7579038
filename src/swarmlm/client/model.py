"""Hugging Face causal LMs whose decoder blocks live in the swarm: embeddings, norm and head stay local."""

from __future__ import annotations

import logging
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarmlm.checks import POSITIVE_INT, check_range
from swarmlm.client.generation import RemoteGenerationMixin, SessionStacks
from swarmlm.client.head_batching import HeadBatcher, LoopHeadBatcher
from swarmlm.client.inference import InferenceSession
from swarmlm.client.lora import DEFAULT_ALPHA, DEFAULT_RANK, DEFAULT_TARGETS, LoraTuning
from swarmlm.client.prompts import PromptTuning
from swarmlm.client.remote_sequential import RemoteSequential, SwarmClient
from swarmlm.client.trace import RequestTrace
from swarmlm.config import ClientConfig
from swarmlm.errors import ConfigError, ModelLoadError
from swarmlm.models.fingerprint import model_fingerprint
from swarmlm.models.loading import checkpoint_dtype, load_config, load_tensors, load_tokenizer, resolve_model
from swarmlm.models.naming import default_dht_prefix
from swarmlm.models.registry import ModelFamily, get_family
from swarmlm.protocol.messages import ServerInfo
from swarmlm.swarm.private import load_swarm_key

logger = logging.getLogger(__name__)


class DistributedCausalLMMixin(RemoteGenerationMixin):
    """Mixed into a family's HF causal LM class: its `model.layers` is a RemoteSequential."""

    family: ModelFamily
    _model_dir: Path
    _tokenizer: PreTrainedTokenizerBase | None

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        model: str | os.PathLike,
        *,
        initial_peers: list[str] | tuple[str, ...] = (),
        dtype: torch.dtype | str = torch.float32,
        torch_dtype: torch.dtype | str | None = None,
        cache_dir: str | os.PathLike | None = None,
        revision: str | None = None,
        tuning_mode: str | None = None,
        pre_seq_len: int | None = None,
        lora_rank: int | None = None,
        lora_alpha: int | None = None,
        lora_target_modules: tuple[str, ...] | list[str] | str | None = None,
        swarm_key: str | os.PathLike | bytes | None = None,
        client: SwarmClient | None = None,
        **client_options: Any,
    ) -> DistributedCausalLMMixin:
        """Load the local parts of `model` (a Hub repository "org/name", a name, .gguf or HF folder) and connect to
        the swarm serving its blocks. A Hub model is fetched at `revision` (a branch, tag or commit; default: its
        default branch), and only the files of the local parts: config, tokenizer and the shards holding the
        embeddings, the final norm and the LM head.

        dtype is that of the local parts ("auto": the checkpoint's); torch_dtype is its older name, as in Petals.
        tuning_mode "ptune" or "deep_ptune" adds pre_seq_len (default 16) trainable prompts (the only trainable
        parameters); "lora" adds trainable LoRA matrices of rank lora_rank (default 8; scaling lora_alpha / lora_rank,
        as PEFT, alpha default 16) on the lora_target_modules (default q_proj, v_proj) of every block (no dropout),
        which travel with every request to the servers. Options of another mode than the one chosen are an error.
        swarm_key: a private swarm's key file (or its 32-byte secret).
        client_options are ClientConfig fields (dht_prefix, max_tokens_per_request, request_timeout_s, ...).
        client: another model's `.client`, loaded from the same checkpoint: this model shares its connection to
        the swarm (one DHT node, one event loop, one view of the servers per process) and its client options, so
        initial_peers, swarm_key and client_options are not given. The connection closes with the last model.
        """
        _check_tuning_options(tuning_mode, pre_seq_len, lora_rank, lora_alpha, lora_target_modules)
        known = {f.name for f in fields(ClientConfig)} - {"initial_peers", "swarm_key"}
        unknown = set(client_options) - known
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; client options are {sorted(known)}")
        if client is None:
            client_config = _client_config(initial_peers, swarm_key, client_options)
        else:
            client_config = _shared_config(client, initial_peers, swarm_key, client_options)
        if tuning_mode == "lora" and client_config.active_adapter is not None:
            # servers refuse every request that carries both (server/validation.py): say so before anything starts
            raise ConfigError(
                f"tuning_mode='lora' and active_adapter={client_config.active_adapter!r} cannot be combined: "
                "servers apply a request's own LoRA weights or a served adapter, not both"
            )
        model_dir = resolve_model(model, cache_dir=cache_dir, revision=revision)
        if client is None and client_config.dht_prefix is None:
            # named after the resolved model, as its servers name it (a Hub model's swarm follows its commit)
            client_config = replace(client_config, dht_prefix=default_dht_prefix(model_dir))
        config = load_config(model_dir)
        dtype = checkpoint_dtype(config) if (torch_dtype or dtype) == "auto" else (torch_dtype or dtype)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
        family = get_family(config)
        distributed_cls = cls if hasattr(cls, "family") else distributed_class(family)
        if distributed_cls.family is not family:
            raise ModelLoadError(f"{cls.__name__} cannot load a {config.model_type!r} model")
        with torch.device("meta"):
            instance = distributed_cls(config)
        instance._load_local_parts(model_dir, dtype)
        # the tokenizer is read from the same folder on first use of `tokenizer` (many clients never need it)
        instance._model_dir, instance._tokenizer = model_dir, None
        instance.prompt_tuning = None
        instance.lora_tuning = None
        instance._session_stacks = SessionStacks()
        # the LM head of concurrent generations (threads sharing this model) runs as one product
        instance._head_batcher = HeadBatcher()
        # ... and so does that of generations running as coroutines on the client's loop (anext_logits)
        instance._loop_heads = LoopHeadBatcher(instance._head_rows)
        if tuning_mode == "lora":
            targets = DEFAULT_TARGETS if lora_target_modules is None else lora_target_modules
            targets = (targets,) if isinstance(targets, str) else tuple(targets)
            rank = DEFAULT_RANK if lora_rank is None else lora_rank
            alpha = DEFAULT_ALPHA if lora_alpha is None else lora_alpha
            instance.lora_tuning = LoraTuning(config, family, str(model), rank, alpha, targets)
        elif tuning_mode is not None:
            instance.prompt_tuning = PromptTuning(
                tuning_mode, 16 if pre_seq_len is None else pre_seq_len, config.hidden_size,
                config.num_hidden_layers, config.initializer_range,
            )  # fmt: skip
        # only servers of this very checkpoint are used, whatever else is announced under the prefix
        fingerprint = model_fingerprint(model_dir)
        if client is None:
            swarm = SwarmClient(client_config, str(client_config.dht_prefix), config.num_hidden_layers, fingerprint)
        else:
            swarm = SwarmClient(None, None, config.num_hidden_layers, fingerprint, share=client)
        instance.model.layers = RemoteSequential(swarm)
        return instance

    def _load_local_parts(self, model_dir: Path, dtype: torch.dtype) -> None:
        tensors = load_tensors(model_dir, self.family.client_tensor_prefixes, dtype=dtype)
        missing, unexpected = self.load_state_dict(tensors, strict=False, assign=True)
        if unexpected:
            raise ModelLoadError(f"unexpected tensors {unexpected[:5]} in {model_dir}")
        head = f"{self.family.head_name}.weight"
        if head not in tensors:
            if not self.config.tie_word_embeddings:
                raise ModelLoadError(f"{model_dir} has no {head} and does not tie embeddings")
            self.get_submodule(self.family.head_name).weight = self.get_submodule(self.family.embed_name).weight
        # the rotary embedding runs on the servers; rebuild it off the meta device so .to() works
        self.model.rotary_emb = self.family.rotary_class(self.config)
        self.model.layers = torch.nn.ModuleList()  # the meta-device blocks are never used
        self.family.client_buffers(self)
        left = [name for name, tensor in self.state_dict(keep_vars=True).items() if tensor.is_meta]
        left += [name for name, buffer in self.named_buffers() if buffer.is_meta]
        if left:
            raise ModelLoadError(f"{model_dir}: the client's parts lack {sorted(set(left))[:5]}")
        self.requires_grad_(False)
        self.eval()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        session: InferenceSession | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits (and loss with labels) of the whole sequence through the swarm. With `session`, only the tokens the
        session has not processed run, through its servers' caches, and the logits are those of the new tokens."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if session is not None:
            if input_ids is None or labels is not None:
                raise ValueError("a forward through an inference session takes input_ids and no labels")
            return self._session_forward(session, input_ids, attention_mask, position_ids, logits_to_keep)
        if inputs_embeds is None:
            inputs_embeds = self.get_submodule(self.family.embed_name)(input_ids)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # the servers' default; saves sending it
        tuning, deep_prompts = self.prompt_tuning, None
        if tuning is not None:
            inputs_embeds, attention_mask, position_ids = tuning.extend(inputs_embeds, attention_mask, position_ids)
            deep_prompts = tuning.deep_prompts
        lora = None if self.lora_tuning is None else self.lora_tuning.weights()
        hidden = self.model.layers(
            inputs_embeds, attention_mask=attention_mask, position_ids=position_ids, prompts=deep_prompts, lora=lora
        )
        hidden = self.get_submodule(self.family.norm_name)(hidden.to(inputs_embeds.dtype))
        if tuning is not None:
            hidden = hidden[:, tuning.pre_seq_len :]  # logits and labels align with the caller's tokens
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.family.final_logits(self.config, self.get_submodule(self.family.head_name)(hidden[:, keep, :]))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer (with its chat template), read offline from the folder the model was loaded from,
        on first use; the same object afterwards."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._model_dir)
        return self._tokenizer

    def save_prompts(self, directory: str | os.PathLike) -> None:
        """Save the trained prompts (a small safetensors file and its settings) to `directory`."""
        self._tuning().save(directory)

    def load_prompts(self, directory: str | os.PathLike) -> None:
        """Load prompts saved by save_prompts into a model made with the same tuning_mode and pre_seq_len."""
        self._tuning().load(directory)

    def save_adapter(self, directory: str | os.PathLike) -> None:
        """Save the LoRA weights (tuning_mode="lora") as a PEFT adapter folder: `swarmlm serve --adapters` serves it
        and peft.PeftModel.from_pretrained loads it."""
        self._lora().save(directory)

    def load_adapter(self, directory: str | os.PathLike) -> None:  # type: ignore[override]
        """Load LoRA weights saved by save_adapter (or PEFT) into a model made with tuning_mode="lora" and the
        same lora_rank, lora_alpha and lora_target_modules."""
        self._lora().load(directory)

    def _lora(self) -> LoraTuning:
        if self.lora_tuning is None:
            raise ValueError("this model has no LoRA weights: load it with tuning_mode='lora'")
        return self.lora_tuning

    def _tuning(self) -> PromptTuning:
        if self.prompt_tuning is None:
            raise ValueError("this model has no prompts: load it with tuning_mode='ptune' or 'deep_ptune'")
        return self.prompt_tuning

    def server_infos(self) -> dict[str, ServerInfo]:
        """What each server of this model's swarm says about itself now (rpc_info), by peer id."""
        return self._client().server_infos()

    def server_info(self, peer_id: str) -> ServerInfo:
        """What one server says about itself now: span, version, fingerprint, limits, free cache and speed."""
        return self._client().server_info(peer_id)

    @property
    def client(self) -> SwarmClient:
        """This model's link to the swarm; pass it as from_pretrained's `client=` to share its connection."""
        return self._client()

    @property
    def last_trace(self) -> RequestTrace | None:
        """The trace of this model's last forward, backward or inference step: servers used, compute vs network
        time, retries, replays and spot checks with their outcomes (client/trace.py)."""
        return self._client().last_trace

    def _client(self) -> SwarmClient:
        layers = self.model.layers
        if not isinstance(layers, RemoteSequential):
            raise RuntimeError("this model is not connected to a swarm")
        return layers.client

    def close(self) -> None:
        """Leave the swarm: stop the client's DHT node and event loop (once no other model shares them)."""
        self._loop_heads.close()
        layers = self.model.layers
        if isinstance(layers, RemoteSequential):
            layers.client.close()

    def __enter__(self) -> DistributedCausalLMMixin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CLASSES: dict[str, type[DistributedCausalLMMixin]] = {}


def distributed_class(family: ModelFamily) -> type[DistributedCausalLMMixin]:
    """The Distributed<Family>ForCausalLM class of a family (e.g. DistributedLlamaForCausalLM), made once."""
    if family.model_type not in _CLASSES:
        base = family.causal_lm_class
        name = f"Distributed{base.__name__}"
        made = type(name, (DistributedCausalLMMixin, base), {"family": family})
        _CLASSES[family.model_type] = cast("type[DistributedCausalLMMixin]", made)
    return _CLASSES[family.model_type]


class AutoDistributedModelForCausalLM:
    """Picks the distributed class from the model's config, like transformers' AutoModelForCausalLM."""

    @staticmethod
    def from_pretrained(model: str | os.PathLike, **kwargs: Any) -> DistributedCausalLMMixin:
        return DistributedCausalLMMixin.from_pretrained(model, **kwargs)


def _client_config(
    initial_peers: object, swarm_key: str | os.PathLike | bytes | None, options: dict[str, Any]
) -> ClientConfig:
    """The client's options, checked (ClientConfig checks its fields) before anything is loaded or started."""
    if isinstance(initial_peers, str) or not isinstance(initial_peers, list | tuple):
        raise ConfigError(f"initial_peers must be a list of multiaddrs, not {initial_peers!r}")
    if not initial_peers:
        raise ConfigError("initial_peers is empty: give the multiaddrs of some peers of the swarm (`swarmlm serve` "
                          "and `swarmlm dht` print them: 'Others join with: --initial-peers ...')")  # fmt: skip
    # no prefix given: from_pretrained names the swarm after the model once it is resolved
    options = {**options, "dht_prefix": options.get("dht_prefix") or None}
    if swarm_key is not None:
        options["swarm_key"] = swarm_key if isinstance(swarm_key, bytes) else load_swarm_key(swarm_key)
    return ClientConfig(initial_peers=tuple(initial_peers), **options)


def _shared_config(client: object, initial_peers: object, swarm_key: object, options: dict[str, Any]) -> ClientConfig:
    """The options of the shared client; those that would configure another connection are refused."""
    if not isinstance(client, SwarmClient):
        raise ConfigError(f"client must be another distributed model's .client, not {type(client).__name__}")
    if client.closed:
        raise ConfigError("client= belongs to a model that was closed")
    given = [name for name, value in (("initial_peers", initial_peers), ("swarm_key", swarm_key)) if value]
    if given or options:
        raise ConfigError(
            f"{', '.join(given + sorted(options))} cannot be combined with client=: a shared connection keeps the "
            "options it was made with (give them to the first model's from_pretrained)"
        )
    return client.config


def _check_tuning_options(
    mode: str | None, pre_seq_len: int | None, rank: int | None, alpha: int | None, targets: object
) -> None:
    """Options of a tuning mode other than the chosen one would be silently ignored: refuse them instead."""
    if mode not in (None, "ptune", "deep_ptune", "lora"):
        raise ConfigError(f"tuning_mode must be None, 'ptune', 'deep_ptune' or 'lora', not {mode!r}")
    for name, value in (("pre_seq_len", pre_seq_len), ("lora_rank", rank), ("lora_alpha", alpha)):
        if value is not None:
            check_range(name, value, POSITIVE_INT)
    lora = {"lora_rank": rank, "lora_alpha": alpha, "lora_target_modules": targets}
    stray = [name for name, value in lora.items() if value is not None] if mode != "lora" else []
    if pre_seq_len is not None and mode not in ("ptune", "deep_ptune"):
        stray.append("pre_seq_len")
    if stray:
        raise ConfigError(f"{', '.join(stray)} do(es) not apply to tuning_mode={mode!r}: "
                          "pre_seq_len is for 'ptune' and 'deep_ptune', lora_* options for 'lora'")  # fmt: skip
