"""Features in combination: a table of server and client options, and a real-swarm test for every pair of them.

Each pair either works, its results equal to the local single-process equivalent within the sum of the two options'
stated tolerances, or is refused with an error that names both options. Pairs of two values of one setting (two wire
dtypes, two tuning modes) are not generated. One swarm runs per server configuration, on the tiny random Llama.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from swarmlm.errors import ConfigError
from swarmlm.models.quant import quantize
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.http_process import run_command
from tests.integration.test_backward_tiny import GRAD_RTOL, local_deep_ptune_logits
from tests.tiny_families import build_adapter

ADAPTER = "served"  # the served adapter's folder name, which clients name it by


def peft_adapter(net: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """The local model with the served adapter, loaded by PEFT: the causal LM with the adapter inside."""
    from peft import PeftModel

    return PeftModel.from_pretrained(net, adapter_dir).base_model.model


def int8_blocks(net: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """The local model with its blocks quantized as the servers quantize them (deterministic: the same weights)."""
    quantize(net.model.layers, "int8")
    return net


@dataclass(frozen=True)
class Option:
    """One value of one setting, other than its default: how to set it, the local equivalent, its tolerance."""

    name: str
    setting: str  # the setting it gives a value: two values of one setting make no pair
    serve: tuple[str, ...] = ()  # `swarmlm serve` flags ("ADAPTER": the served adapter's folder)
    client: Mapping[str, Any] = field(default_factory=dict)  # from_pretrained keywords
    generate: Mapping[str, Any] = field(default_factory=dict)  # generate() keywords; none: plain greedy decoding
    # turns the local fp32 model into the option's equivalent (a client's own prompts or LoRA matrices are added by
    # the Reference's hooks; generation options are run locally by the checks)
    local: Callable[[torch.nn.Module, Path], torch.nn.Module] | None = None
    logits_atol: float = 0.0  # allowed |logits - reference|, absolute ...
    logits_rtol: float = 0.0  # ... and as a fraction of the reference's largest |logit|
    grad_rtol: float = 0.0  # allowed |gradient - reference|, as a fraction of the largest reference gradient


OPTIONS = (
    # the client names no adapter: the base model, also from servers that hold one
    Option("adapters", "server adapters", serve=("--adapters", "ADAPTER")),
    # README: through a swarm, equal to the same quantization run locally
    Option("quant-int8", "server quant", serve=("--quant", "int8"), client={"accepted_dtypes": ("int8",)},
           local=int8_blocks),
    # README states no tolerance for a bfloat16 server; measured on this model: logits within 1.0% of the largest,
    # input gradients within 1.2% of the largest (6 batches of 2x9 tokens through 2 servers)
    Option("server-bf16", "server dtype", serve=("--dtype", "bfloat16"), logits_rtol=0.03, grad_rtol=0.04),
    Option("no-push", "push", client={"use_push": False}),  # push on is the default of every other pair
    Option("active-adapter", "client adapter", serve=("--adapters", "ADAPTER"), client={"active_adapter": ADAPTER},
           local=peft_adapter),
    # README: logits within 0.05 (bfloat16) and 0.03 (int8); gradients within 2% and 5% of the largest
    Option("wire-bf16", "wire dtype", client={"wire_dtype": "bfloat16"}, logits_atol=0.05, grad_rtol=0.02),
    Option("wire-int8", "wire dtype", client={"wire_dtype": "int8"}, logits_atol=0.03, grad_rtol=0.05),
    Option("verify", "verification", client={"verify_probability": 1.0}),  # and every check agrees
    Option("speculative", "speculative decoding", generate={"prompt_lookup_num_tokens": 3}),  # local greedy
    Option("beam", "beam search", generate={"num_beams": 2}),  # a local beam search
    Option("deep-ptune", "tuning mode", client={"tuning_mode": "deep_ptune", "pre_seq_len": 2}),
    Option("lora", "tuning mode",
           client={"tuning_mode": "lora", "lora_rank": 4, "lora_alpha": 8,
                   "lora_target_modules": ("q_proj", "v_proj", "down_proj")}),
)  # fmt: skip
BY_NAME = {option.name: option for option in OPTIONS}


@dataclass(frozen=True)
class Refusal:
    at: str  # "serve": the server stops at start-up; "client": from_pretrained, a request or generate() raises
    message: str  # words of the error, naming both options
    error: type[Exception] = ValueError  # what the client raises


# pairs that must be refused
QUANT_WITH_ADAPTERS = Refusal("serve", "--quant and --adapters cannot be combined")
REFUSED: dict[frozenset[str], Refusal] = {
    frozenset({"adapters", "quant-int8"}): QUANT_WITH_ADAPTERS,
    frozenset({"quant-int8", "active-adapter"}): QUANT_WITH_ADAPTERS,  # naming an adapter needs an --adapters server
    frozenset({"speculative", "beam"}): Refusal(
        "client", "prompt_lookup_num_tokens) is greedy only: leave do_sample and num_beams"
    ),
    # servers refuse requests that carry both (server/validation.py); from_pretrained refuses the pair at once
    frozenset({"active-adapter", "lora"}): Refusal(
        "client", "tuning_mode='lora' and active_adapter='served' cannot be combined", ConfigError
    ),
}
# pairs that fail for a cause outside this test's reach: pair -> the cause
BROKEN: dict[frozenset[str], str] = {}

PAIRS = [(a.name, b.name) for a, b in itertools.combinations(OPTIONS, 2) if a.setting != b.setting]

IDS = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(24))
PROMPT = torch.tensor([[7, 8, 9, 7, 8, 9]])  # repeats itself: prompt lookup finds proposals
NEW_TOKENS = 5
EOS = 2  # the tiny Llama's end of sequence: min_new_tokens keeps generate() from choosing it
BEAMS = 2
# spans of every swarm: a chain of two servers (so steps are pushed and cross a hop), and for pairs with
# verification a second chain split elsewhere, so that every route has a span another server holds whole and one
# that others hold only in two hops (results rounded by a narrow wire at other boundaries)
CHAIN, REPLICAS = [(0, 2), (2, 5)], [(0, 3), (3, 5)]


def options_of(pair: tuple[str, str]) -> list[Option]:
    return [BY_NAME[name] for name in pair]


def server_flags(pair: tuple[str, str]) -> tuple[str, ...]:
    """The `swarmlm serve` flags of a pair's servers: one swarm runs per distinct set ("ADAPTER" left to replace)."""
    sets: list[tuple[str, ...]] = []
    for option in options_of(pair):
        if option.serve and option.serve not in sets:  # the adapter's two options load it alike
            sets.append(option.serve)
    return tuple(flag for flags in sorted(sets) for flag in flags)


# grouped by server configuration, so that each swarm runs once
WORKING = sorted((pair for pair in PAIRS if frozenset(pair) not in REFUSED), key=server_flags)
# server configurations whose pairs check results against a second chain
CHECKED = {server_flags(pair) for pair in WORKING if "verify" in pair}


def pair_id(pair: tuple[str, str]) -> str:
    return "-x-".join(pair)


def marked(pair: tuple[str, str]) -> Any:
    """The pytest parameter of a working pair (xfail, with its cause, where it is known to fail)."""
    cause = BROKEN.get(frozenset(pair))
    marks = [pytest.mark.xfail(strict=True, reason=cause)] if cause else []
    return pytest.param(server_flags(pair), pair, id=pair_id(pair), marks=marks)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tiny_model_dir, tmp_path_factory.mktemp("combinations") / ADAPTER, seed=1)


def with_adapter(flags: tuple[str, ...], adapter_dir: Path) -> list[str]:
    return [str(adapter_dir) if flag == "ADAPTER" else flag for flag in flags]


@pytest.fixture(scope="module")
def swarm(request: pytest.FixtureRequest, tiny_model_dir: Path, adapter_dir: Path) -> Iterator[LocalSwarm]:
    """The swarm of one server configuration (request.param: its flags); pytest runs its pairs together."""
    spans = CHAIN + (REPLICAS if request.param in CHECKED else [])
    with running_swarm(tiny_model_dir, spans, extra_args=with_adapter(request.param, adapter_dir)) as swarm:
        yield swarm


class Reference:
    """The local equivalent of a pair: the tiny model in one process (PEFT with the adapter, int8 blocks) and, by
    hooks written here, the client's own deep prompts or LoRA matrices (so that gradients reach the same tensors)."""

    def __init__(self, net: torch.nn.Module, model: torch.nn.Module):
        self.net, self.prompts, self.lora = net, model.prompt_tuning, model.lora_tuning

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with self._lora_hooks():
            if self.prompts is not None:
                return local_deep_ptune_logits(self.net, self.net.model.embed_tokens(ids), self.prompts)
            return self.net(ids).logits

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        with self._lora_hooks():
            return self.net(ids, labels=ids).loss

    @contextlib.contextmanager
    def _lora_hooks(self) -> Iterator[None]:
        """Each target module's output plus scaling * x A^T B^T, as LoRA (without dropout) defines it."""
        handles = []
        if self.lora is not None:
            scaling = self.lora.spec.scaling
            for name, a, b in zip(self.lora.names(), self.lora.lora_A, self.lora.lora_B, strict=True):
                module = self.net.get_submodule(name.removeprefix("base_model.model."))
                hook = functools.partial(_add_lora, a=a, b=b, scaling=scaling)
                handles.append(module.register_forward_hook(hook))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _add_lora(
    module: torch.nn.Module, args: tuple, output: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    return output + scaling * F.linear(F.linear(args[0], a), b)


def reference_net(pair: tuple[str, str], model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    net = load_reference(model_dir)
    for option in options_of(pair):
        if option.local is not None:
            net = option.local(net, adapter_dir)
    return net.requires_grad_(False).eval()


@dataclass(frozen=True)
class Tolerance:
    logits: float  # absolute
    grad_rtol: float


def tolerance(pair: tuple[str, str], reference_logits: torch.Tensor) -> Tolerance:
    """The pair's tolerance: the sum of its options' (errors of independent roundings add up at worst)."""
    options = options_of(pair)
    scale = reference_logits.abs().max().item()
    logits = LOGITS_ATOL + sum(o.logits_atol + o.logits_rtol * scale for o in options)
    return Tolerance(logits, GRAD_RTOL + sum(o.grad_rtol for o in options))


def client_options(pair: tuple[str, str], swarm: LocalSwarm) -> dict[str, Any]:
    """from_pretrained keywords: the options', and without verification checks off and the first chain only."""
    options: dict[str, Any] = {}
    for option in options_of(pair):
        options.update(option.client)
    if "verify" not in pair:
        chain = tuple(server.peer_id for server in swarm.servers[: len(CHAIN)])
        options.update(verify_probability=0.0, verify_first_requests=0, allowed_servers=chain)
    return options


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Trainable parameters that change the outputs: PEFT starts LoRA's B and deep prompts at zero."""
    torch.manual_seed(0)
    with torch.no_grad():
        if model.prompt_tuning is not None:
            model.prompt_tuning.deep_prompts.normal_(std=0.5)
        if model.lora_tuning is not None:
            for b in model.lora_tuning.lora_B:
                b.normal_(std=0.2)
    return model


def assert_checked(model: torch.nn.Module, pair: tuple[str, str]) -> None:
    """With verification, the last request's results were checked on other servers and agreed. Under an int8 wire,
    results are compared only with those of one server holding the whole span (README): the others stay unchecked."""
    if "verify" not in pair:
        return
    trace = model.last_trace
    outcomes = {check.outcome for check in trace.checks}
    allowed = {"agreed", "unchecked"} if "wire-int8" in pair else {"agreed"}
    assert "agreed" in outcomes and outcomes <= allowed, trace.summary()


def check_forward(model: torch.nn.Module, reference: Reference, pair: tuple[str, str]) -> Tolerance:
    with torch.inference_mode():
        expected = reference.logits(IDS)
        logits = model(IDS).logits
    tol = tolerance(pair, expected)
    assert_checked(model, pair)
    error = (logits - expected).abs().max().item()
    assert error <= tol.logits, f"logits differ by {error:.2e} > {tol.logits:.2e}"
    return tol


def _gradients(parameters: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    for parameter in parameters:
        parameter.grad = None
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in parameters])


def check_gradients(model: torch.nn.Module, reference: Reference, tol: Tolerance) -> None:
    """Deep prompts: gradients of a fixed function of the logits; LoRA: the loss and its gradients."""
    weights = torch.randn(*IDS.shape, 128, generator=torch.Generator().manual_seed(5))
    if model.prompt_tuning is not None:
        parameters = [model.prompt_tuning.deep_prompts, model.prompt_tuning.prompt_embeddings]
        remote = _gradients(parameters, (model(IDS).logits * weights).sum())
        local = _gradients(parameters, (reference.logits(IDS) * weights).sum())
    else:
        parameters = [*model.lora_tuning.lora_A, *model.lora_tuning.lora_B]
        remote_loss, local_loss = model(IDS, labels=IDS).loss, reference.loss(IDS)
        # a cross entropy moves by at most twice the largest logit error
        assert abs(remote_loss.item() - local_loss.item()) <= 2 * tol.logits
        remote, local = _gradients(parameters, remote_loss), _gradients(parameters, local_loss)
    scale = local.abs().max().item()
    assert scale > 0, "a zero gradient proves nothing"
    error = (remote - local).abs().max().item()
    assert error <= tol.grad_rtol * scale + 1e-7, f"gradients differ by {error / scale:.2e} of the largest"


def check_backward_from_kept(logs: list[tuple[Path, int]]) -> None:
    """The training step's backward ran from the graphs its forward kept on the servers (server/activations.py),
    with no forward recomputed: keeping works under the pair's options. logs: each server's log and its size
    before the step."""
    written = ""
    for path, size in logs:
        with path.open(errors="replace") as log:
            log.seek(size)
            written += log.read()
    assert "runs from its kept forward" in written, written[-3000:]
    assert "recomputes its forward" not in written, written[-3000:]


def _eos_masked(logits: torch.Tensor) -> torch.Tensor:
    """Logits as generate() sees them under min_new_tokens: the end of sequence ruled out."""
    logits = logits.clone()
    logits[..., EOS] = -torch.inf
    return logits


def check_greedy(output: torch.Tensor, reference: Reference, tol: Tolerance) -> None:
    """Every generated token is one the local model picks given the same prefix, up to near ties: its local logit
    lies within twice the tolerance of the largest (for exact pairs: the local greedy tokens)."""
    assert output.shape == (1, PROMPT.shape[1] + NEW_TOKENS)
    assert torch.equal(output[:, : PROMPT.shape[1]], PROMPT)
    with torch.inference_mode():
        logits = _eos_masked(reference.logits(output[:, :-1]))[0, PROMPT.shape[1] - 1 :]
    chosen = logits.gather(-1, output[0, PROMPT.shape[1] :, None])[:, 0]
    gaps = logits.max(-1).values - chosen
    assert gaps.max().item() <= 2 * tol.logits, f"token(s) local greedy would not choose: gaps {gaps.tolist()}"


def local_beam_search(reference: Reference) -> tuple[list[int], float]:
    """Beam search of BEAMS beams without length penalty over the local logits: (best sequence, its log-prob)."""
    beams: list[tuple[list[int], float]] = [(PROMPT[0].tolist(), 0.0)]
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = reference.logits(torch.tensor([tokens for tokens, _ in beams]))[:, -1]
            totals = torch.tensor([score for _, score in beams])[:, None] + _eos_masked(logits.log_softmax(-1))
            top, vocab = totals.flatten().topk(BEAMS), totals.shape[1]
            picked = zip(top.values.tolist(), top.indices.tolist(), strict=True)
            beams = [(beams[i // vocab][0] + [i % vocab], value) for value, i in picked]
    return beams[0]


def check_beam(result: Any, reference: Reference, tol: Tolerance, exact: bool) -> None:
    """The swarm's score of its best sequence is the local log-prob of that sequence (a cache row reordered wrongly
    changes it); exact pairs also find the local beam search's sequence."""
    sequence = result.sequences[0]
    assert sequence.shape == (PROMPT.shape[1] + NEW_TOKENS,)
    with torch.inference_mode():
        log_probs = reference.logits(sequence[None, :-1])[0, PROMPT.shape[1] - 1 :].log_softmax(-1)
    local_score = log_probs.gather(-1, sequence[PROMPT.shape[1] :, None]).sum().item()
    # each step's log-softmax moves by at most twice the largest logit error
    assert abs(result.sequences_scores[0].item() - local_score) <= 2 * NEW_TOKENS * tol.logits
    if exact:
        best, best_score = local_beam_search(reference)
        assert sequence.tolist() == best
        assert abs(local_score - best_score) <= 1e-4


def pushes(model: torch.nn.Module) -> int:
    return sum(info.pushes_received for info in model.server_infos().values())


def check_generation(model: torch.nn.Module, reference: Reference, pair: tuple[str, str], tol: Tolerance) -> None:
    """Greedy, speculative or beam generation, as the pair says, against the local equivalent."""
    options: dict[str, Any] = {}
    for option in options_of(pair):
        options.update(option.generate)
    before = pushes(model)
    common = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    if "beam" in pair:
        result = model.generate(PROMPT, **common, **options, do_sample=False, length_penalty=0.0,
                                output_scores=True, return_dict_in_generate=True)  # fmt: skip
        check_beam(result, reference, tol, exact=tol.logits == LOGITS_ATOL)
    else:
        check_greedy(model.generate(PROMPT, **common, **options, do_sample=False), reference, tol)
    assert_checked(model, pair)
    pushed = pushes(model) - before
    if "no-push" in pair:
        assert pushed == 0
    elif "beam" not in pair and "lora" not in pair and "verify" not in pair:
        assert pushed > 0, "push is on by default: steps after the first go from server to server"  # README


@pytest.mark.parametrize(("swarm", "pair"), [marked(pair) for pair in WORKING], indirect=["swarm"], scope="module")
def test_a_pair_of_options_equals_the_local_equivalent(
    tiny_model_dir: Path, adapter_dir: Path, swarm: LocalSwarm, pair: tuple[str, str]
) -> None:
    with connected_model(tiny_model_dir, swarm, **client_options(pair, swarm)) as model:
        reference = Reference(reference_net(pair, tiny_model_dir, adapter_dir), randomized(model))
        tol = check_forward(model, reference, pair)
        if model.prompt_tuning is not None or model.lora_tuning is not None:
            logs = [(server.log_path, server.log_path.stat().st_size) for server in swarm.servers]
            check_gradients(model, reference, tol)
            check_backward_from_kept(logs)
        check_generation(model, reference, pair, tol)


@functools.cache
def serve_refusal(model_dir: Path, flags: tuple[str, ...]) -> str:
    """The output of a server started with `flags`, which must stop with an error before it serves (pairs that
    need the same flags share one start)."""
    args = [sys.executable, "-m", "swarmlm.cli.main", "serve", str(model_dir), "--blocks", "0:5", "--new-swarm",
            "--host", "127.0.0.1", *flags]  # fmt: skip
    done = run_command(args, timeout=120)
    assert done.returncode != 0, "the server started"
    return done.stdout + done.stderr


def refused(at: str) -> list[Any]:
    pairs = [pair for pair in PAIRS if frozenset(pair) in REFUSED and REFUSED[frozenset(pair)].at == at]
    return [pytest.param(server_flags(pair), pair, id=pair_id(pair)) for pair in pairs]


@pytest.mark.parametrize(("flags", "pair"), refused("serve"))
def test_server_options_that_cannot_work_together_stop_the_server(
    tiny_model_dir: Path, adapter_dir: Path, flags: tuple[str, ...], pair: tuple[str, str]
) -> None:
    output = serve_refusal(tiny_model_dir, tuple(with_adapter(flags, adapter_dir)))
    assert REFUSED[frozenset(pair)].message in output


@pytest.mark.parametrize(("swarm", "pair"), refused("client"), indirect=["swarm"], scope="module")
def test_client_options_that_cannot_work_together_are_refused(
    tiny_model_dir: Path, swarm: LocalSwarm, pair: tuple[str, str]
) -> None:
    refusal = REFUSED[frozenset(pair)]
    options: dict[str, Any] = {}
    for option in options_of(pair):
        options.update(option.generate)
    # refused by from_pretrained, by the first request or by generate()
    with pytest.raises(refusal.error, match=re.escape(refusal.message)):
        with connected_model(tiny_model_dir, swarm, **client_options(pair, swarm)) as model:
            model(IDS)
            model.generate(PROMPT, max_new_tokens=NEW_TOKENS, **options)
