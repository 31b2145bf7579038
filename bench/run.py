"""Benchmark: forward throughput and one-token latency of a loopback swarm against the same model in one process."""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil
import torch
import transformers
from targets import line as target_line

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.client.trace import RequestTrace
from swarmlm.config import ClientConfig
from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm, even_spans

BATCH, SEQ = 8, 128  # the throughput workload: BATCH sequences of SEQ tokens in one forward call
MAX_LOGITS_DIFF = 1e-3  # largest tolerated |swarm - local| of any logit
WARMUP_CALLS = 2  # untimed calls before every timed series
DEFAULT_THROUGHPUT_REPEATS = 5
DEFAULT_LATENCY_REPEATS = 20
QUICK_THROUGHPUT_REPEATS, QUICK_LATENCY_REPEATS = 1, 3
SEED = 0
# above this many cores of CPU used by other processes while timing, the figures are flagged as unreliable
FOREIGN_LOAD_WARN_CORES = 0.15

# torch's default intra-op threads, read before anything changes them; spawned servers inherit the same default
DEFAULT_TORCH_THREADS = torch.get_num_threads()

Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Plan:
    warmup: int  # untimed calls before each series
    throughput_repeats: int  # timed BATCH x SEQ forward calls
    latency_repeats: int  # timed one-token forward calls


@dataclass(frozen=True)
class Timing:
    seconds: tuple[float, ...]  # one wall-clock duration per timed call

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def describe(self) -> str:
        ms = [s * 1000 for s in self.seconds]
        return f"median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, max {max(ms):.1f}, n={len(ms)})"


@dataclass(frozen=True)
class Row:
    metric: str
    local: float
    swarm: float


def busy_cpu_seconds() -> float:
    """CPU time all processes on this machine have used since boot (idle, I/O wait and steal excluded)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def own_cpu_seconds() -> float:
    """CPU time of this process and of every live process it started (servers, DHT nodes, p2pd daemons)."""
    me = psutil.Process()
    total = 0.0
    for process in (me, *me.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue  # it exited meanwhile
        total += times.user + times.system
    return total


class ForeignLoad:
    """Measures the CPU other processes use while the benchmark times calls: other work skews the figures."""

    cores: float = 0.0  # average cores used by processes outside this benchmark

    def __enter__(self) -> ForeignLoad:
        self._began = (time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        ended = (time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds())
        wall, busy, own = (end - begin for begin, end in zip(self._began, ended, strict=True))
        self.cores = max(busy - own, 0.0) / max(wall, 1e-9)

    def report(self) -> None:
        print(f"other processes used {self.cores:.2f} of {psutil.cpu_count()} cores while timing", flush=True)
        if self.cores > FOREIGN_LOAD_WARN_CORES:
            print("WARNING: the machine was busy with other work; the figures are skewed, rerun when it is quiet")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or Hugging Face folder")
    parser.add_argument("--servers", type=int, default=2, help="servers the blocks are split evenly over")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per series (default: 5 and 20)")
    parser.add_argument("--quick", action="store_true", help="tiny repeats: a smoke check, not a measurement")
    parser.add_argument(
        "--max-tokens-per-request",
        type=int,
        default=ClientConfig.max_tokens_per_request,
        help="client sub-batch size in tokens; smaller sub-batches let the servers pipeline",
    )
    parser.add_argument(
        "--server-threads", type=int, default=None, help="torch threads per server (default: torch's default)"
    )
    args = parser.parse_args(argv)
    if args.servers < 1 or (args.repeats is not None and args.repeats < 1) or args.max_tokens_per_request < 1:
        parser.error("--servers, --repeats and --max-tokens-per-request must be positive")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        warmup, throughput, latency = 1, QUICK_THROUGHPUT_REPEATS, QUICK_LATENCY_REPEATS
    else:
        warmup, throughput, latency = WARMUP_CALLS, DEFAULT_THROUGHPUT_REPEATS, DEFAULT_LATENCY_REPEATS
    if args.repeats is not None:
        throughput = latency = args.repeats
    return Plan(warmup, throughput, latency)


def forward_fn(model: torch.nn.Module) -> Forward:
    """A call of the model on input ids that returns its logits, without KV cache or autograd."""

    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids, use_cache=False).logits

    return forward


def timed_call(forward: Forward, input_ids: torch.Tensor) -> float:
    began = time.perf_counter()
    forward(input_ids)
    return time.perf_counter() - began


def time_interleaved(
    forwards: dict[str, Forward], input_ids: torch.Tensor, warmup: int, repeats: int
) -> dict[str, Timing]:
    """Warm up every forward, then time them in turns, so that a change of machine load hits all of them alike."""
    for _ in range(warmup):
        for forward in forwards.values():
            forward(input_ids)
    seconds: dict[str, list[float]] = {name: [] for name in forwards}
    for _ in range(repeats):
        for name, forward in forwards.items():
            seconds[name].append(timed_call(forward, input_ids))
    return {name: Timing(tuple(values)) for name, values in seconds.items()}


def load_local(folder: os.PathLike) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def max_logits_diff(local: Forward, swarm: Forward, input_ids: torch.Tensor) -> float:
    return (swarm(input_ids) - local(input_ids)).abs().max().item()


def cores_line() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{os.cpu_count()} logical, {psutil.cpu_count(logical=False)} physical, {usable} usable by this process"


def print_header(args: argparse.Namespace, folder: os.PathLike, spans: Sequence[tuple[int, int]], plan: Plan) -> None:
    server_threads = args.server_threads or f"torch default ({DEFAULT_TORCH_THREADS})"
    print(f"model           {args.model}  ({folder}, float32)")
    print(f"servers         {len(spans)}, blocks " + ", ".join(f"{a}:{b}" for a, b in spans))
    print(f"threads         client/local {torch.get_num_threads()}, each server {server_threads}")
    print(f"cores           {cores_line()}")
    print(f"client          max_tokens_per_request={args.max_tokens_per_request}")
    print(
        f"method          {plan.warmup} warm-up calls, then median of {plan.throughput_repeats} "
        f"({BATCH}x{SEQ}) / {plan.latency_repeats} (1x1) timed calls; torch {torch.__version__}"
    )
    sys.stdout.flush()


def print_table(rows: Sequence[Row]) -> None:
    print(f"\n{'metric':<30} {'local':>10} {'swarm':>10}   ratio (swarm/local)")
    for row in rows:
        print(f"{row.metric:<30} {row.local:>10.1f} {row.swarm:>10.1f}   {row.swarm / row.local:.2f}")
    print(target_line("forward", rows[0].swarm / rows[0].local))


def measure_throughput(forwards: dict[str, Forward], plan: Plan) -> Row:
    input_ids = torch.randint(0, 10_000, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    timings = time_interleaved(forwards, input_ids, plan.warmup, plan.throughput_repeats)
    tokens_per_s = {name: BATCH * SEQ / timing.median for name, timing in timings.items()}
    for name, timing in timings.items():
        print(f"{name} forward {BATCH}x{SEQ}: {timing.describe()} -> {tokens_per_s[name]:.0f} tokens/s", flush=True)
    return Row(f"forward {BATCH}x{SEQ} tokens/s", tokens_per_s["local"], tokens_per_s["swarm"])


def measure_latency(forwards: dict[str, Forward], plan: Plan) -> Row:
    timings = time_interleaved(forwards, torch.tensor([[42]]), plan.warmup, plan.latency_repeats)
    for name, timing in timings.items():
        print(f"{name} 1-token forward: {timing.describe()}", flush=True)
    return Row("1-token latency ms", timings["local"].median * 1000, timings["swarm"].median * 1000)


def print_trace(trace: RequestTrace | None) -> None:
    """Where the last timed swarm forward went: each call's time by the client's clock and its server's compute."""
    if trace is None:
        return
    print(f"the last swarm forward {BATCH}x{SEQ}: {trace.summary()}")
    for call in trace.calls:
        print(f"  {call.kind} blocks {call.start}:{call.end} on ...{call.peer_id[-6:]}: {call.total_ms:.1f} ms, "
              f"{call.compute_ms:.1f} of them the server's compute")  # fmt: skip
    sys.stdout.flush()


def check_logits(local: Forward, swarm: Forward) -> None:
    input_ids = torch.randint(0, 10_000, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED + 1))
    diff = max_logits_diff(local, swarm, input_ids)
    print(f"max |swarm - local| logit on {BATCH}x{SEQ} tokens: {diff:.2e} (limit {MAX_LOGITS_DIFF:.0e})", flush=True)
    if not diff <= MAX_LOGITS_DIFF:
        raise SystemExit(f"FAILED: the swarm's logits differ from the local model's by {diff:.3e}")


def run_swarm(args: argparse.Namespace, local: Forward, spans: Sequence[tuple[int, int]], plan: Plan) -> list[Row]:
    with LocalSwarm(args.model, threads_per_server=args.server_threads) as swarm:
        began = time.perf_counter()
        swarm.start_servers(spans)
        print(f"servers ready in {time.perf_counter() - began:.1f} s (logs in {swarm.log_dir})", flush=True)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            args.model, initial_peers=swarm.initial_peers, max_tokens_per_request=args.max_tokens_per_request
        )
        try:
            forwards = {"local": local, "swarm": forward_fn(model)}
            check_logits(local, forwards["swarm"])
            with ForeignLoad() as load:
                rows = [measure_throughput(forwards, plan)]
                print_trace(model.last_trace)
                rows.append(measure_latency(forwards, plan))
            load.report()
            return rows
        finally:
            model.close()


def main(argv: Sequence[str] | None = None) -> None:
    began = time.perf_counter()
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    transformers.utils.logging.disable_progress_bar()
    plan = make_plan(args)
    torch.manual_seed(SEED)
    folder = resolve_model(args.model)
    spans = even_spans(load_config(folder).num_hidden_layers, args.servers)
    print_header(args, folder, spans, plan)
    local = forward_fn(load_local(folder))
    rows = run_swarm(args, local, spans, plan)
    print_table(rows)
    print(f"\ntotal time {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
