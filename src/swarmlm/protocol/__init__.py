"""What crosses the wire: message headers, named tensor bundles, tensor encodings (16-bit and int8 wires),
the typed table of RPC methods."""
