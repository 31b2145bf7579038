"""Imports every built-in family file, each of which registers itself."""

from swarmlm.models import gemma3, llama, mistral, mixtral, phi3, qwen2, qwen3  # noqa: F401
