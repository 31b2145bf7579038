"""`swarmlm train`: prompt tuning or LoRA of the bundled model on the shipped sentiment task, through a swarm."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from swarmlm.client.prompts import IGNORE_INDEX
from swarmlm.errors import ConfigError

# the data set stays in the package's examples/ folder (package data), one level above this tools/ package
DATASET = Path(__file__).parent.parent / "examples" / "sentiment.jsonl"
LABELS = ("positive", "negative")
# Adam learning rates that train well on this task (prompts: 1e-2 and above diverge)
DEFAULT_LR = {"ptune": 3e-3, "deep_ptune": 3e-3, "lora": 1e-3}
QUESTION = "Is the sentiment of this review positive or negative? Answer with one word.\nReview: {text}"


@dataclass(frozen=True)
class Example:
    text: str
    label: str


def load_examples(path: Path = DATASET) -> list[Example]:
    examples = [Example(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    unknown = {e.label for e in examples} - set(LABELS)
    if unknown:
        raise ValueError(f"{path}: unknown labels {sorted(unknown)}")
    return examples


def split_examples(examples: Sequence[Example], held_out: int, seed: int = 0) -> tuple[list, list]:
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    return shuffled[held_out:], shuffled[:held_out]


class SentimentTask:
    """Turns examples into chat-formatted token batches whose loss covers the one-word answer only."""

    # a transformers tokenizer (typed Any: its methods return unions that depend on their flags)
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # the answers' first tokens: classification compares their logits after the prompt
        self.label_ids = [tokenizer(label, add_special_tokens=False).input_ids[0] for label in LABELS]

    def prompt_ids(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": QUESTION.format(text=text)}]
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]

    def batch(self, examples: Sequence[Example], with_answers: bool) -> dict[str, torch.Tensor]:
        """Right-padded input_ids, attention_mask, labels (answer tokens only) and each row's last prompt index."""
        rows, labels, last = [], [], []
        for example in examples:
            prompt = self.prompt_ids(example.text)
            answer = self.tokenizer(example.label, add_special_tokens=False).input_ids if with_answers else []
            rows.append(prompt + answer)
            labels.append([IGNORE_INDEX] * len(prompt) + answer)
            last.append(len(prompt) - 1)
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return {
            "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for lab in labels]),
            "last_prompt_index": torch.tensor(last),
        }

    def accuracy(self, model: torch.nn.Module, examples: Sequence[Example], batch_size: int = 16) -> float:
        """Share of examples whose answer token scores higher than the other label's."""
        correct = 0
        with torch.no_grad():
            for chunk in _chunks(examples, batch_size):
                batch = self.batch(chunk, with_answers=False)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                last = logits[torch.arange(len(chunk)), batch["last_prompt_index"]][:, self.label_ids]
                predicted = [LABELS[i] for i in last.argmax(-1).tolist()]
                correct += sum(p == e.label for p, e in zip(predicted, chunk, strict=True))
        return correct / len(examples)

    def loss(self, model: torch.nn.Module, examples: Sequence[Example]) -> torch.Tensor:
        batch = self.batch(examples, with_answers=True)
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


def _chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for begin in range(0, len(items), size):
        yield items[begin : begin + size]


def train_prompts(
    model: torch.nn.Module, task: SentimentTask, examples: Sequence[Example], *, steps: int, batch_size: int,
    lr: float, seed: int = 0,
) -> list[float]:  # fmt: skip
    """Adam over the model's trainable parameters (its prompts or LoRA weights); a progress bar shows the running
    loss."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    rng, losses = random.Random(seed), []
    what = "LoRA" if getattr(model, "lora_tuning", None) is not None else "prompts"
    with tqdm(range(steps), desc=f"training {what}", unit="step") as progress:
        for _ in progress:
            loss = task.loss(model, rng.sample(list(examples), batch_size))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            progress.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    return losses


@dataclass(frozen=True)
class TrainOptions:
    model: str = "smollm2-135m-instruct"  # model to tune
    revision: str | None = None  # branch, tag or commit of a Hub model (None: its default branch)
    initial_peers: tuple[str, ...] = ()  # an existing swarm to use; empty: start a local one
    servers: int = 2  # servers of the local swarm
    tuning_mode: str = "deep_ptune"  # ptune | deep_ptune | lora
    pre_seq_len: int = 8  # prompt length (ptune, deep_ptune)
    lora_rank: int = 8  # LoRA rank (lora)
    lora_alpha: int = 16  # LoRA scaling is lora_alpha / lora_rank (lora)
    lora_target_modules: tuple[str, ...] = ("q_proj", "v_proj")  # modules of every block LoRA adapts (lora)
    steps: int = 30  # optimizer steps
    batch_size: int = 8  # examples per step
    lr: float | None = None  # Adam learning rate (None: DEFAULT_LR of the tuning mode)
    held_out: int = 80  # examples kept for the accuracy check
    save_dir: str | None = None  # where to save the trained prompts, or the LoRA adapter (a PEFT folder)
    swarm_key_file: str | None = None  # a private swarm's key file: the swarm joined, or the local one started private


def run_training(options: TrainOptions) -> tuple[float, float]:
    """Accuracy on held-out examples before and after training prompts or LoRA weights through a swarm."""
    from swarmlm.client.model import AutoDistributedModelForCausalLM
    from swarmlm.models.loading import load_config, load_tokenizer, resolve_model
    from swarmlm.tools.local_swarm import start_even_swarm

    train_set, held_out = split_examples(load_examples(), options.held_out)
    if not 1 <= options.batch_size <= len(train_set):  # checked before the model loads and any server starts
        raise ConfigError(
            f"--batch-size {options.batch_size}: must be from 1 up to {len(train_set)}, the task's training examples"
        )
    model_dir = resolve_model(options.model, revision=options.revision)
    task = SentimentTask(load_tokenizer(model_dir))
    swarm, peers = None, options.initial_peers
    if not peers:
        print(f"Starting {options.servers} local servers for {options.model} ...", flush=True)
        swarm = start_even_swarm(
            str(model_dir), load_config(model_dir).num_hidden_layers, options.servers, options.swarm_key_file
        )
        peers = tuple(swarm.initial_peers)
    try:
        with AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), initial_peers=peers, swarm_key=options.swarm_key_file, **tuning_options(options)
        ) as model:
            before = task.accuracy(model, held_out)
            print(f"Held-out accuracy before training: {before:.1%} ({len(held_out)} examples)", flush=True)
            lr = options.lr if options.lr is not None else DEFAULT_LR[options.tuning_mode]
            train_prompts(model, task, train_set, steps=options.steps, batch_size=options.batch_size, lr=lr)
            after = task.accuracy(model, held_out)
            print(f"Held-out accuracy after training:  {after:.1%}", flush=True)
            if options.save_dir and options.tuning_mode == "lora":
                model.save_adapter(options.save_dir)
                print(f"LoRA adapter saved to {options.save_dir} (serve it with swarmlm serve --adapters)")
            elif options.save_dir:
                model.save_prompts(options.save_dir)
                print(f"Prompts saved to {options.save_dir}")
    finally:
        if swarm is not None:
            swarm.close()
    return before, after


def tuning_options(options: TrainOptions) -> dict[str, Any]:
    """from_pretrained's keywords for the options' tuning mode."""
    if options.tuning_mode not in DEFAULT_LR:
        raise ValueError(f"tuning_mode must be one of {sorted(DEFAULT_LR)}, not {options.tuning_mode!r}")
    if options.tuning_mode == "lora":
        return dict(tuning_mode="lora", lora_rank=options.lora_rank, lora_alpha=options.lora_alpha,
                    lora_target_modules=options.lora_target_modules)  # fmt: skip
    return dict(tuning_mode=options.tuning_mode, pre_seq_len=options.pre_seq_len)
