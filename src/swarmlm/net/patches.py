"""Patches to hivemind 1.1.12's P2P for what it offers no option for (applied only where a caller asks)."""

from __future__ import annotations

from hivemind.p2p import P2P


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
