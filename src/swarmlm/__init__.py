"""swarmlm: run and fine-tune large language models over a swarm of servers. Public names only."""

from __future__ import annotations

import logging
import os
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

# hivemind shares its futures' state between processes with torch's "file_system" strategy unless told otherwise (it
# reads this variable once, when it is first imported): every process that makes such a future (each server, its DHT
# process, each client) then starts a torch_shm_manager helper, ~0.15 s of CPU and one process more each. The
# "file_descriptor" strategy, torch's own default on Linux, shares the same memory through descriptors with no helper.
# A value set by the user stays
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

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
