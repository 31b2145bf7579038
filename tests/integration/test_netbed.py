"""The emulated network itself: the delaying relay, hosts that reach each other only over the bridge, and cleanup
of every namespace, link and process, also when a run fails or is killed."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from swarmlm.tools.netbed import hosts
from swarmlm.tools.netbed.hosts import NetBed
from swarmlm.tools.netbed.relay import LinkShape, serve

needs_namespaces = pytest.mark.skipif(hosts.unavailable() is not None, reason=str(hosts.unavailable()))


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trips(shape: LinkShape, payload: int, trips: int) -> list[float]:
    """Seconds of each of `trips` echoes of `payload` bytes through a relay with `shape` both ways."""
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    echo_port = echo.sockets[0].getsockname()[1]
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    relay_port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    relay = asyncio.create_task(serve(("127.0.0.1", relay_port), ("127.0.0.1", echo_port), shape, shape))
    try:
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
        times = []
        for _ in range(trips):
            began = time.perf_counter()
            writer.write(b"x" * payload)
            await writer.drain()
            await reader.readexactly(payload)
            times.append(time.perf_counter() - began)
        writer.close()
        return times
    finally:
        relay.cancel()
        echo.close()


def test_the_relay_adds_its_delay_each_way_and_keeps_the_bytes() -> None:
    fast = asyncio.run(_round_trips(LinkShape(), 100, 5))
    slow = asyncio.run(_round_trips(LinkShape(delay_s=0.05), 100, 5))
    assert min(slow) >= 0.1  # 50 ms each way
    assert min(slow) > min(fast) + 0.09
    assert max(slow) < 1.0  # generous: a loaded 2-core machine


def test_the_relay_caps_the_rate() -> None:
    # 1 MB at 20 Mbit/s takes 0.4 s each way (the echo overlaps the two directions); unlimited it takes ~10 ms
    (seconds,) = asyncio.run(_round_trips(LinkShape(rate_bps=20e6), 1_000_000, 1))
    assert seconds >= 0.38


@needs_namespaces
def test_hosts_reach_each_other_and_everything_is_removed_at_the_end() -> None:
    with NetBed(2, rate_mbit=50) as bed:
        a, b = bed.hosts
        listener = bed.spawn(b, [sys.executable, "-c", textwrap.dedent(f"""
            import socket
            s = socket.create_server(("{b.address}", 5000)); print("up", flush=True)
            c, _ = s.accept(); c.sendall(c.recv(100))
            """)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
        connect = f"import socket; c = socket.create_connection(('{b.address}', 5000), 5)"
        talk = connect + "; c.sendall(b'hi'); print(c.recv(9))"
        out = subprocess.run(a.command([sys.executable, "-c", talk]), capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "b'hi'", out.stderr
        # the root namespace has no route to the hosts' subnet: their traffic stays on the bridge
        root = subprocess.run([sys.executable, "-c", talk], capture_output=True, text=True, timeout=30)
        assert root.returncode != 0
        sleeper = bed.spawn(a, ["sleep", "600"])
        assert len(bed.leftovers()) == 5  # two namespaces, the bridge, two veth ends
    assert bed.leftovers() == []
    assert sleeper.poll() is not None


@needs_namespaces
def test_a_failure_inside_the_bed_still_removes_it() -> None:
    with pytest.raises(RuntimeError, match="boom"), NetBed(1) as bed:
        raise RuntimeError("boom")
    assert bed.leftovers() == []


@needs_namespaces
def test_what_a_killed_run_left_behind_is_removed_by_the_next() -> None:
    script = "from swarmlm.tools.netbed.hosts import NetBed; import json, time; b = NetBed(2); " \
             "print(json.dumps([h.name for h in b.hosts] + [b.bridge]), flush=True); time.sleep(600)"  # fmt: skip
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        names = json.loads(run.stdout.readline() if run.stdout else "[]")
        run.send_signal(signal.SIGKILL)
        run.wait()
        assert set(names) <= set(hosts.bed_namespaces() + hosts.bed_links())  # nothing ran its cleanup
        removed = hosts.remove_orphans()
        assert set(names) <= set(removed)
        assert not set(names) & set(hosts.bed_namespaces() + hosts.bed_links())
    finally:
        run.kill()
