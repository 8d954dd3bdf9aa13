"""Reward model: Bradley-Terry training on preference pairs learns the preference, its HF export
scores like the megatron model, and PPO uses it as the reward."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.data import load_reasoning_gym
from megarl.reward_model_trainer import RewardModelTrainer
from megarl.trainer import Trainer
from tests.helpers.runs import tiny_model, tiny_run_config


def write_pairs(path: Path, n: int, seed: int) -> None:
    """Chosen: the bare answer. Rejected: an evasive sentence. A clear, learnable preference."""
    records = load_reasoning_gym("basic_arithmetic", n, seed=seed)
    evasive = ["I am not sure.", "Let me think about it later.", "Numbers are hard, sorry!", "Maybe ask someone else?"]
    with path.open("w") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({"prompt": r.prompt, "chosen": str(r.answer), "rejected": evasive[i % 4]}) + "\n")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("rm_models"))


def test_bradley_terry_learns_and_exports_and_feeds_ppo(model, tmp_path):
    write_pairs(tmp_path / "train.jsonl", 64, seed=1)
    write_pairs(tmp_path / "eval.jsonl", 16, seed=2)
    cfg = tiny_run_config(model, tmp_path / "rm", "trainer.mode=reward_model", "reward_model.enabled=true",
                          "data.source=jsonl", f"data.path={tmp_path / 'train.jsonl'}",
                          f"data.eval_path={tmp_path / 'eval.jsonl'}", "reward.kind=model",
                          "reward_model.optim.lr=3e-3", "reward_model.micro_batch_size=8",
                          "batch.global_batch_size=16", "trainer.total_steps=12")
    results = RewardModelTrainer(cfg).run()
    before, after = results["eval_before"], results["eval_after"]
    assert after["eval/pair_accuracy"] >= 0.9 > before["eval/pair_accuracy"] or after["eval/margin_mean"] > before["eval/margin_mean"] + 1.0
    assert after["eval/pair_accuracy"] >= 0.9
    losses = [s["rm/loss"] for s in results["steps"]]
    assert losses[-1] < losses[0]

    # the HF export is a sequence classifier whose scores reproduce the megatron evaluation
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(results["export"]).eval()
    tok = AutoTokenizer.from_pretrained(results["export"])
    trainer = RewardModelTrainer(cfg)
    trainer.tokenizer = tok
    from megarl.data import load_preferences

    pairs = load_preferences(tmp_path / "eval.jsonl")
    batch = trainer.encode(pairs)
    with torch.no_grad():
        scores = torch.tensor([hf(torch.tensor([seq])).logits[0, 0].item() for seq in (batch.sequence(i).tolist() for i in range(len(batch)))])
    margin = scores[0::2] - scores[1::2]
    assert abs(float(margin.mean()) - after["eval/margin_mean"]) < 1e-3
    assert abs(float((margin > 0).float().mean()) - after["eval/pair_accuracy"]) < 1e-6

    # PPO scores rollouts with the trained reward model
    ppo = tiny_run_config(model, tmp_path / "ppo", "reward.kind=model", "reward_model.enabled=true",
                          f"reward_model.model_path={results['export']}", "trainer.total_steps=1",
                          "trainer.eval_before_after=false", "checkpoint.export_hf=false")
    step = Trainer(ppo).run()["steps"][0]
    assert step["reward/std"] > 0 and all(map(lambda k: torch.isfinite(torch.tensor(step[k])), ("reward/mean", "actor/pg_loss")))
