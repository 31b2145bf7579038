"""The simulated world's inputs and their defaults: the model, the hardware mix, regions and round trips, churn and
demand. Every figure has its source or its reason next to it; docs/simulator.md explains them."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from swarmlm.swarm.routing import DEFAULT_HOP_COST_S

# Llama-2/3 70B: 80 decoder blocks of ~0.86e9 parameters, hidden size 8192 (from the models' config.json)
LLAMA_70B_BLOCKS = 80
BLOCK_PARAMS = 0.86e9
HIDDEN_SIZE = 8192
# weights and activations in 16 bits
BYTES_PER_PARAM = 2
# memory a server keeps for its KV cache, activations and the CUDA context, in GB (the rest holds blocks)
RESERVED_GB = 4.0
# fraction of the peak memory bandwidth a decode step reaches (one row reads every weight once: memory-bound)
DECODE_BANDWIDTH_EFFICIENCY = 0.6
# fraction of peak 16-bit tensor FLOPs a prefill or training pass reaches
COMPUTE_EFFICIENCY = 0.4
# a batched decode step of b sessions costs (1 + BATCH_SLOPE * (b - 1)) times one session's step:
# bench/decode_batch.py, one server of 15 blocks: 22 ms for 1 session, 31 for 4, 42 for 8 (docs/benchmarks.md)
BATCH_SLOPE = 0.13
# the most sessions one server batches in a step (the decode bound counts every server at this batch)
MAX_BATCH = 64
# KV cache a server keeps per block it holds, in tokens (--cache-tokens): Petals' default for models with grouped KV
# heads (attn_cache_tokens = 16384; 4 KB a token a block for a 70B Llama, ~64 MB a block): ~8 chats of 2k tokens
CACHE_TOKENS_PER_BLOCK = 16384
# inference sessions a server holds open at most (ServerConfig.max_sessions' default)
MAX_SESSIONS = 256
# client-side cost of a generated token: final norm, LM head and sampling (docs/benchmarks.md: ~5 ms)
CLIENT_TOKEN_S = 0.005


@dataclass(frozen=True)
class Gpu:
    """One kind of server hardware: its share of the servers and its public spec-sheet figures."""

    name: str
    share: float  # fraction of servers with this GPU
    memory_gb: float  # device memory
    bandwidth_gbs: float  # peak memory bandwidth, GB/s
    tflops: float  # peak dense 16-bit tensor TFLOPs
    net_mbits: float  # median network bandwidth of such a server, Mbit/s (home uplinks vs data centres)


# consumer cards dominate volunteer swarms; a minority of rented data-centre GPUs (NVIDIA spec sheets)
GPU_MIX = (
    Gpu("RTX 3060 12GB", 0.15, 12, 360, 25, 50),
    Gpu("RTX 3090", 0.35, 24, 936, 71, 100),
    Gpu("RTX 4090", 0.30, 24, 1008, 165, 100),
    Gpu("A100 80GB", 0.15, 80, 2039, 312, 2000),
    Gpu("H100 80GB", 0.05, 80, 3350, 990, 5000),
)

# regions, the share of servers and of users in each, and median public round trips between them in ms (rounded
# medians of public inter-city ping tables such as WonderNetwork's; within a region, home links add up to ~20 ms)
REGIONS = ("us-east", "us-west", "europe", "east-asia", "south-america")
REGION_SHARES = (0.30, 0.15, 0.30, 0.20, 0.05)
RTT_MS = (
    (20, 65, 80, 180, 120),
    (65, 20, 140, 120, 170),
    (80, 140, 20, 230, 200),
    (180, 120, 230, 20, 290),
    (120, 170, 200, 290, 20),
)


@dataclass(frozen=True)
class Scenario:
    """Everything a run depends on besides the seed."""

    servers: int = 1000  # server machines, each online for heavy-tailed sessions with pauses between them
    clients: int = 10000  # users over the run: chat users and a few training jobs
    hours: float = 24.0  # simulated time
    seed: int = 0
    placement: str = "swarmlm"  # "swarmlm" (placement.py), "petals" (Petals' rule) or "random"
    num_blocks: int = LLAMA_70B_BLOCKS
    uptime_median_h: float = 6.0  # lognormal session length of a server (sigma UPTIME_SIGMA: heavy tail)
    downtime_median_h: float = 3.0  # lognormal pause between a server's sessions
    abrupt_share: float = 0.3  # fraction of server departures that are crashes (the rest drain gracefully)
    outage_hour: float | None = 12.0  # when outage_share of the online servers vanish at once (None: never)
    outage_share: float = 0.3
    training_share: float = 0.01  # fraction of clients that are training jobs instead of chat users
    step_tokens: int = 16  # generated tokens simulated as one event (latency is computed per token)
    rebalance_interval_s: float = 60.0  # ServerConfig.rebalance_interval_s (Petals' rule: 120, its default)
    balance_quality: float = 0.75  # ServerConfig.balance_quality (Petals' default is the same)
    sample_s: float = 300.0  # period of the throughput, bound and coverage samples
    gpus: tuple[Gpu, ...] = field(default=GPU_MIX)
    region_shares: tuple[float, ...] = REGION_SHARES  # of servers and of users, one per region
    rtt_ms: tuple[tuple[float, ...], ...] = RTT_MS  # round trips between regions
    hop_s: float = DEFAULT_HOP_COST_S  # (de)serializing and dispatching a hop, on top of its round trip
    client_token_s: float = CLIENT_TOKEN_S  # the client's own cost per generated token
    batch_slope: float = BATCH_SLOPE  # see batched_step_s
    cache_tokens: int = CACHE_TOKENS_PER_BLOCK  # ServerConfig.cache_tokens: KV-cache tokens per block a server holds
    max_sessions: int = MAX_SESSIONS  # ServerConfig.max_sessions: inference sessions a server holds open at most

    def __post_init__(self) -> None:
        if self.servers < 1 or self.clients < 0 or not self.hours > 0 or self.num_blocks < 1:
            raise ValueError("a scenario needs servers >= 1, clients >= 0, hours > 0 and num_blocks >= 1")
        if len(self.rtt_ms) != len(self.region_shares) or any(len(row) != len(self.rtt_ms) for row in self.rtt_ms):
            raise ValueError("rtt_ms must be a square matrix with one row per region of region_shares")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {self.placement!r}")


PLACEMENTS = ("swarmlm", "petals", "random")
UPTIME_SIGMA = 1.2  # lognormal shape of server sessions: many short ones, a few lasting days
DOWNTIME_SIGMA = 1.0


def block_gb() -> float:
    return BLOCK_PARAMS * BYTES_PER_PARAM / 1e9


def blocks_held(gpu: Gpu, num_blocks: int) -> int:
    """How many blocks a server with this GPU holds: its memory, less RESERVED_GB, in whole blocks (at least 1)."""
    return max(1, min(num_blocks, int((gpu.memory_gb - RESERVED_GB) / block_gb())))


def decode_step_s(gpu: Gpu) -> float:
    """One block's decode step of one session: reading the block's weights once at the reachable bandwidth."""
    return block_gb() / (gpu.bandwidth_gbs * DECODE_BANDWIDTH_EFFICIENCY)


def compute_throughput(gpu: Gpu) -> float:
    """Block-tokens per second of prefill or training compute (what a server announces as its throughput)."""
    return gpu.tflops * 1e12 * COMPUTE_EFFICIENCY / (2 * BLOCK_PARAMS)


def batched_step_s(single_s: float, batch: int, slope: float = BATCH_SLOPE) -> float:
    """A decode step of `batch` sessions on one block, from one session's step (BATCH_SLOPE by default)."""
    return single_s * (1.0 + slope * max(0, batch - 1))


def decode_capacity(single_s: float, slope: float = BATCH_SLOPE) -> float:
    """Block-steps per second of a server at MAX_BATCH: its share of the decode bound."""
    return MAX_BATCH / batched_step_s(single_s, MAX_BATCH, slope)


def pick(rng: random.Random, shares: tuple[float, ...]) -> int:
    """An index drawn with the given probabilities."""
    return rng.choices(range(len(shares)), weights=shares)[0]


def lognormal_s(rng: random.Random, median_h: float, sigma: float) -> float:
    return 3600.0 * median_h * math.exp(sigma * rng.gauss(0.0, 1.0))


def diurnal_time(rng: random.Random, hours: float) -> float:
    """An arrival time in [0, hours) under a daily cycle: the rate peaks at 15:00 and is a fifth of it at 03:00."""
    while True:
        t = rng.uniform(0.0, hours)
        rate = 0.6 + 0.4 * math.cos(2 * math.pi * (t % 24 - 15) / 24)
        if rng.random() < rate:
            return t * 3600.0


@dataclass(frozen=True)
class Chat:
    """One user's conversation: turns of (prompt tokens, answer tokens, think seconds before the next turn)."""

    turns: tuple[tuple[int, int, float], ...]

    @property
    def max_length(self) -> int:
        """The tokens its session reserves in the servers' caches: the whole conversation (at most MAX_CONTEXT)."""
        return min(MAX_CONTEXT, sum(prompt + answer for prompt, answer, _ in self.turns))


# token lengths of chat turns: lognormal shapes with medians near those of ShareGPT conversations (the traces vLLM's
# serving benchmarks replay: prompts of a few hundred tokens, answers of ~200), capped at a 4k context
PROMPT_MEDIAN, PROMPT_SIGMA, ANSWER_MEDIAN, ANSWER_SIGMA = 150, 0.9, 200, 0.7
MAX_CONTEXT = 4096
MEAN_TURNS, MEAN_THINK_S = 4.0, 20.0


def draw_chat(rng: random.Random) -> Chat:
    turns, used = [], 0
    while used < MAX_CONTEXT // 2:
        prompt = max(1, min(2000, int(PROMPT_MEDIAN * math.exp(PROMPT_SIGMA * rng.gauss(0, 1)))))
        answer = max(1, min(1024, int(ANSWER_MEDIAN * math.exp(ANSWER_SIGMA * rng.gauss(0, 1)))))
        turns.append((prompt, answer, rng.expovariate(1 / MEAN_THINK_S)))
        used += prompt + answer
        if rng.random() < 1 / MEAN_TURNS:
            break
    return Chat(tuple(turns))


# a training job: batches of TRAIN_TOKENS tokens, forward and backward, for a lognormal time (median an hour)
TRAIN_TOKENS = 8 * 256
TRAIN_MEDIAN_H, TRAIN_SIGMA = 1.0, 0.8
# a training step costs this many forward passes of compute (forward, then backward: recomputed forward + 2x)
TRAIN_PASSES = 4
