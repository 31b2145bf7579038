"""Benchmark: where one user's decode step spends its time. A 2-server loopback swarm generates greedily for one user
while py-spy samples the client and both servers.

Prints the wall time per token against local generate(); the CPU ms per generated token of every process (the
client, each server, the p2p daemons and DHT processes, which are not Python and are measured, not sampled); and for
the client and each server the share of its on-CPU samples by component (model compute in torch and transformers,
the asyncio event loop, hivemind's p2p layer, protobuf, swarmlm's own code, other) with its top functions by own
time. Needs py-spy (`pip install py-spy`) and the right to trace processes (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm, even_spans

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SAMPLE_RATE = 200  # py-spy samples per second
# the component of a sample, by the file of its innermost Python frame as py-spy names it, "function (path:line)"
# with the path relative to its site-packages (first match wins)
COMPONENTS = [
    ("model compute (torch, transformers)", ("(torch/", "(transformers/")),
    ("event loop (asyncio, selectors)", ("(asyncio/", "(selectors.py")),
    ("p2p layer (hivemind)", ("(hivemind/",)),
    ("protobuf", ("(google/protobuf/",)),
    ("swarmlm", ("(swarmlm/",)),
    ("threads and queues", ("(threading.py", "(concurrent/", "(queue.py")),
]


def component(frame: str) -> str:
    for name, markers in COMPONENTS:
        if any(marker in frame for marker in markers):
            return name
    return "other"


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process and, under "<name> helpers", of its descendants (its p2p daemon
    and DHT process; the client's also the swarm's bootstrap node) that are not named processes (or theirs)."""
    found: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            process = psutil.Process(pid)
            times = process.cpu_times()
            found[name] = times.user + times.system
            helpers = 0.0
            for child in _helpers(process, set(pids.values())):
                child_times = child.cpu_times()
                helpers += child_times.user + child_times.system
            found[f"{name} helpers (p2pd, DHT)"] = helpers
        except psutil.Error:
            continue
    return found


def _helpers(process: psutil.Process, named: set[int]) -> list[psutil.Process]:
    found = []
    for child in process.children():
        if child.pid in named or "py-spy" in " ".join(child.cmdline()):
            continue
        found += [child, *_helpers(child, named)]
    return found


def py_spy() -> str:
    """The py-spy command (on PATH or beside this Python), or exit saying how to get it."""
    beside = Path(sys.executable).parent / "py-spy"
    found = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
    if found is None:
        raise SystemExit("this profile needs py-spy: pip install py-spy")
    return found


def start_sampling(spy: str, pid: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--rate", str(SAMPLE_RATE), "--format", "raw", "--nonblocking",
         "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def stop_sampling(spy: subprocess.Popen) -> None:
    spy.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
    try:
        spy.wait(60)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


def read_samples(path: Path) -> Counter[tuple[str, ...]]:
    """Stacks (outermost frame first) and their sample counts, from py-spy's raw (collapsed) output."""
    stacks: Counter[tuple[str, ...]] = Counter()
    if not path.exists():
        return stacks
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def report(name: str, stacks: Counter[tuple[str, ...]], cpu_ms: float) -> None:
    """The samples' shares by component and function; ms per token: a share of the process's measured CPU time
    (py-spy's samples of threads it deems active only apportion it)."""
    total = sum(stacks.values())
    if not total:
        print(f"\n{name}: no samples (py-spy could not trace it?)")
        return
    by_component: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    for stack, count in stacks.items():
        by_component[component(stack[-1])] += count
        by_function[stack[-1]] += count
    print(f"\n{name}: {total} samples of active threads; {cpu_ms:.1f} CPU ms per token")
    for part, count in by_component.most_common():
        print(f"  {part:<40}{100 * count / total:>6.1f}%  ~{cpu_ms * count / total:>6.2f} CPU ms/token")
    print("  top functions by own time:")
    for function, count in by_function.most_common(12):
        print(f"  {100 * count / total:>6.1f}%  {function[:150]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="generations sampled (after one warm-up)")
    args = parser.parse_args()
    if os.geteuid() != 0 and Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip() != "0":
        raise SystemExit("py-spy needs to trace other processes: run as root or set kernel.yama.ptrace_scope=0")
    spy = py_spy()
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    ids = load_tokenizer(model_dir)(PROMPT, return_tensors="pt")["input_ids"]
    # no end-of-sequence token: every generation is new_tokens long without min_new_tokens, whose logits processor
    # costs the client more than its LM head on a large vocabulary
    generate = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=[])

    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        local.generate(ids, **generate)
        began = time.perf_counter()
        for _ in range(args.rounds):
            local.generate(ids, **generate)
        local_ms = (time.perf_counter() - began) * 1000 / (args.rounds * args.new_tokens)

    with LocalSwarm(str(model_dir)) as swarm, tempfile.TemporaryDirectory() as scratch:
        servers = swarm.start_servers(even_spans(config.num_hidden_layers, 2))
        with AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), initial_peers=swarm.initial_peers
        ) as model, torch.inference_mode():  # fmt: skip
            model.generate(ids, **generate)  # warm-up: routes, connections, the servers' first steps
            pids = {"client": os.getpid(), **{f"server {s.start}:{s.end}": s.process.pid for s in servers}}
            spies = {name: start_sampling(spy, pid, Path(scratch) / f"{pid}.txt") for name, pid in pids.items()}
            time.sleep(1.0)  # py-spy attaches
            before, began = cpu_seconds(pids), time.perf_counter()
            for _ in range(args.rounds):
                model.generate(ids, **generate)
            wall_s = time.perf_counter() - began
            for sampling in spies.values():  # before reading the CPU times: that reading is not the run's
                stop_sampling(sampling)
            after = cpu_seconds(pids)
        tokens = args.rounds * args.new_tokens
        swarm_ms = wall_s * 1000 / tokens
        print(f"model {args.model}, 2 servers, one user, {tokens} tokens sampled ({args.rounds} x {args.new_tokens})")
        print(f"\nwall ms per token: local {local_ms:.1f}, swarm {swarm_ms:.1f} (ratio local/swarm "
              f"{local_ms / swarm_ms:.2f}); the swarm's excess: {swarm_ms - local_ms:.1f} ms per token")  # fmt: skip
        print("\nCPU ms per token (all processes of the run; more than the wall time means processes overlapped):")
        for name in after:
            print(f"  {name:<40}{(after[name] - before.get(name, 0.0)) * 1000 / tokens:>8.2f}")
        for name, pid in pids.items():
            cpu_ms = (after[name] - before.get(name, 0.0)) * 1000 / tokens
            report(name, read_samples(Path(scratch) / f"{pid}.txt"), cpu_ms)


if __name__ == "__main__":
    main()
