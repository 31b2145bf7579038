"""The server: a span of blocks served over the network layer, with admission limits, a scheduler, KV caches,
placement and push."""
