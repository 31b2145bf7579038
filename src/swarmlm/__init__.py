"""swarmlm: run and fine-tune large language models over a swarm of servers. Public names only."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from swarmlm.errors import (
    BadRequestError,
    ConfigError,
    MissingAdapterError,
    MissingBlocksError,
    ModelLoadError,
    ProtocolError,
    RemoteCallError,
    SessionClosedError,
    SwarmBusyError,
    SwarmError,
    UnreachablePeersError,
)
from swarmlm.version import __version__ as __version__

if TYPE_CHECKING:
    from swarmlm.client.model import AutoDistributedModelForCausalLM
    from swarmlm.client.remote_sequential import RemoteSequential
    from swarmlm.client.tokenizer import AutoTokenizer
    from swarmlm.config import ClientConfig, ServerConfig


class _DropOptionalKernelNotice(logging.Filter):
    """bitsandbytes (installed for `--quant nf4`; PEFT imports it whenever it is there) warns at import that an
    optional fused kernel fetched from the Hugging Face Hub is missing. Only its own Linear4bit uses that kernel,
    never this project's code, so the notice would only mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropOptionalKernelNotice())

# heavy modules (torch, transformers, hivemind) load on first use, not on `import swarmlm`
_LAZY = {
    "AutoDistributedModelForCausalLM": "swarmlm.client.model",
    "AutoTokenizer": "swarmlm.client.tokenizer",
    "RemoteSequential": "swarmlm.client.remote_sequential",
    "ClientConfig": "swarmlm.config",
    "ServerConfig": "swarmlm.config",
}

__all__ = [
    "AutoDistributedModelForCausalLM",
    "AutoTokenizer",
    "BadRequestError",
    "ClientConfig",
    "ConfigError",
    "MissingAdapterError",
    "MissingBlocksError",
    "ModelLoadError",
    "ProtocolError",
    "RemoteCallError",
    "RemoteSequential",
    "ServerConfig",
    "SessionClosedError",
    "SwarmBusyError",
    "SwarmError",
    "UnreachablePeersError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swarmlm' has no attribute {name!r}")
