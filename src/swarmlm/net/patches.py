"""Patches to hivemind 1.1.12's P2P for what it offers no option for (applied only where a caller asks)."""

from __future__ import annotations

import logging

from hivemind.p2p import P2P

# hivemind logs p2pd's own error lines and its stream handlers' failures here, at WARNING, to its stderr handler
P2PD_LOGGER = "hivemind.p2p.p2p_daemon"
logger = logging.getLogger(__name__)


class _TransportToDebug(logging.Filter):
    """Moves p2pd's messages to this package's log at DEBUG: a failed stream or a reset connection is noise the
    client recovers from (its trace counts the retries), not a line for the user's terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or getattr(record, "caller", None) == "p2pd":
            logger.debug("p2p: %s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


def quiet_transport_logs() -> None:
    """Keep p2pd's transport noise off stderr (once per process; the DHT's child inherits it when forked after)."""
    daemon_logger = logging.getLogger(P2PD_LOGGER)
    if not any(isinstance(each, _TransportToDebug) for each in daemon_logger.filters):
        daemon_logger.addFilter(_TransportToDebug())


def use_only_static_relays() -> None:
    """Make this process's p2pd reserve a slot on its trusted relays at once (called in the DHT's own child).

    hivemind 1.1.12 always starts p2pd with relay discovery, and p2pd then waits for 4 relay candidates or 3 minutes
    before it reserves a slot anywhere; with discovery off, the trusted relays are its static relays and it reserves
    on them immediately. hivemind has no option for this flag, so the child's P2P gets it added to its arguments.
    """
    make_args = P2P._make_process_args

    def with_static_relays(*args: object, **kwargs: object) -> list[str]:
        return make_args(*args, **({**kwargs, "relayDiscovery": False} if kwargs.get("autoRelay") else kwargs))

    P2P._make_process_args = staticmethod(with_static_relays)
