"""The exceptions swarmlm raises: one small hierarchy so callers can catch what they can handle."""

# Error text in replies and log lines is cut to this many characters: a hostile header must not echo back in full.
MAX_ERROR_CHARS = 500


def short(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class SwarmError(Exception):
    """Base class of every error raised by swarmlm."""


class ConfigError(SwarmError, ValueError):
    """An option has a value of the wrong type or out of its range; the message names the option."""


class UnreachablePeersError(SwarmError):
    """None of the initial peers answered, so the swarm could not be joined."""


class ModelLoadError(SwarmError):
    """A model could not be found, converted or read."""


class MissingBlocksError(SwarmError):
    """No server in the swarm covers some blocks, even after waiting."""

    def __init__(self, missing: list[int], waited_s: float):
        self.missing = list(missing)
        self.waited_s = waited_s
        super().__init__(
            f"No server serves block(s) {_format_ranges(self.missing)} (waited {waited_s:.1f} s). "
            f"Start a server for them, e.g. `swarmlm serve MODEL --blocks {self.missing[0]}:{self.missing[-1] + 1} "
            f"--initial-peers ...`"
        )


class MissingAdapterError(MissingBlocksError):
    """Servers answer for some blocks, but none of them holds the LoRA adapter the client asked for: waiting would not
    help, so this is raised at once. `held` says which adapters the servers of those blocks hold."""

    def __init__(self, adapter: str, missing: list[int], held: list[str]):
        SwarmError.__init__(
            self,
            f"No server serves LoRA adapter {adapter!r} for block(s) {_format_ranges(missing)}; the servers of those "
            f"blocks hold: {'; '.join(held)}. Serve it with `swarmlm serve MODEL --blocks {missing[0]}:"
            f"{missing[-1] + 1} --adapters PATH/{adapter} --initial-peers ...`, or name an adapter they hold",
        )
        self.missing, self.waited_s = list(missing), 0.0
        self.adapter, self.held = adapter, list(held)


class ProtocolError(SwarmError):
    """A message on the wire is malformed, of an unknown version, or violates the server's limits."""


class LimitError(ProtocolError):
    """A request is refused by a server limit, not because it is malformed; error_kind says which kind of limit."""

    def __init__(self, message: str, error_kind: str):
        super().__init__(message)
        self.error_kind = error_kind  # "busy": room may come later; "too_large": never here, maybe elsewhere


class RemoteCallError(SwarmError):
    """A call to a server failed: connection error, timeout or an error reply."""

    def __init__(self, message: str, peer_id: str | None = None):
        self.peer_id = peer_id
        super().__init__(message if peer_id is None else f"{message} (peer ...{peer_id[-6:]})")


class SwarmBusyError(RemoteCallError):
    """Every server that could serve some blocks answered busy (they hold all the sessions they have room for):
    the swarm is full now. retry_after_s is when to try again, from the servers' own estimates."""

    def __init__(self, start: int, end: int, waited_s: float, retry_after_s: float):
        self.start, self.end, self.waited_s, self.retry_after_s = start, end, waited_s, retry_after_s
        super().__init__(
            f"The swarm is full: every server of blocks {start}:{end} answered busy (waited {waited_s:.1f} s). "
            f"Try again in {max(1.0, retry_after_s):.0f} s, or start a server for these blocks to add room"
        )


class UnreachableError(RemoteCallError):
    """A server could not be connected to at the addresses it announced (an announcement is a claim: anyone can
    publish one): it costs one short dial and is then avoided, without using up the request's retries."""


class BadRequestError(RemoteCallError):
    """A server rejected the request itself as invalid: retrying on another server would not help."""


class SessionClosedError(SwarmError):
    """An operation was attempted on a session that is already closed."""


def _format_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, idx in enumerate(indices):
        if start is None:
            start = idx
        if i + 1 == len(indices) or indices[i + 1] != idx + 1:
            parts.append(str(start) if start == idx else f"{start}-{idx}")
            start = None
    return ", ".join(parts)
