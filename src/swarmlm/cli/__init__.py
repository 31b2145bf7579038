"""The `swarmlm` command: one parser per command, argument checks that fail in one line, the options reference."""
