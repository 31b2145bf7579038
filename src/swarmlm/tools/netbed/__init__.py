"""An emulated multi-host network on one Linux machine, for tests and benchmarks: namespaces, links, delays."""
