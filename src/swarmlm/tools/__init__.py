"""Tooling, not imported by the library: local swarms for demos and tests, an emulated network test bed, the demo.

It also holds the training example. The library packages (client, server, swarm, protocol, models, api) never import
this package; only the CLI's commands and the API service start tooling here, on purpose and lazily.
"""
