"""Deep prompt tuning of the bundled SmolLM2 through a real swarm: a few optimizer steps lower the task's loss."""

from __future__ import annotations

from pathlib import Path

import torch

from swarmlm.models.loading import load_tokenizer
from swarmlm.train import SentimentTask, load_examples, split_examples
from tests.conftest import connected_model, running_swarm


def test_a_few_steps_lower_the_loss_and_prompts_round_trip(smollm_dir: Path, tmp_path: Path) -> None:
    task = SentimentTask(load_tokenizer(smollm_dir))
    train_set, _ = split_examples(load_examples(), held_out=80)
    batch = train_set[:6]
    with running_swarm(smollm_dir, [(0, 15), (15, 30)]) as swarm:
        torch.manual_seed(0)  # the prompts' initial values
        with connected_model(smollm_dir, swarm, tuning_mode="deep_ptune", pre_seq_len=4) as model:
            optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)  # frozen parameters are simply skipped
            losses = []
            for _ in range(4):
                loss = task.loss(model, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            with torch.no_grad():
                final = task.loss(model, batch).item()
            model.save_prompts(tmp_path)
            expected = model.prompt_tuning.deep_prompts.detach().clone()
        assert final < losses[0] * 0.9, (losses, final)
        with connected_model(smollm_dir, swarm, tuning_mode="deep_ptune", pre_seq_len=4) as fresh:
            fresh.load_prompts(tmp_path)
            assert torch.equal(fresh.prompt_tuning.deep_prompts, expected)
            with torch.no_grad():
                assert abs(task.loss(fresh, batch).item() - final) < 1e-4
