"""Model families and weights: checkpoints and GGUF files, spans of blocks, batched decode, adapters,
quantization, fingerprints."""
