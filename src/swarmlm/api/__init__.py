"""The OpenAI-compatible HTTP API over a swarm and the swarm monitor (page, JSON and terminal status)."""
