"""A discrete-event simulator of a large swarm whose placement, routing and recovery decisions are made by the
project's own pure functions (`swarmlm simulate`)."""
