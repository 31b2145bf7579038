"""The client: models whose blocks run remotely, routes over the swarm, forward/backward through spans,
inference sessions and generation, spot checks."""
