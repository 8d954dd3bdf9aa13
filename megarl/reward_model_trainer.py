"""Reward-model training (``trainer.mode: reward_model``): Bradley-Terry on preference pairs.

The reward model is the policy's trunk with a scalar head (the same megatron model a critic uses),
scored at the last token of ``prompt + response + EOS``. The trained model is exported as an HF
``*ForSequenceClassification`` folder (``score.weight``), which ``reward_model.model_path`` of a
PPO recipe then loads.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from megarl.checkpoint.hf_export import export_hf_folder
from megarl.config import RunConfig
from megarl.metrics_log import MetricsLogger, note
from megarl.placement import RunPlacement


class RewardModelTrainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.group = None
        self.logger = None

    def setup(self) -> None:
        from megarl.data import load_preferences
        from megarl.workers import WorkerGroup
        from megarl.workers.model_source import load_tokenizer, resolve_hf_path

        cfg, d = self.cfg, self.cfg.data
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model_dir = resolve_hf_path(cfg.reward_model.model_path or cfg.model.hf_path)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or str(self.model_dir))
        self.train_pairs = load_preferences(d.path, d.prompt_key, d.chosen_key, d.rejected_key)
        self.eval_pairs = load_preferences(d.eval_path, d.prompt_key, d.chosen_key, d.rejected_key) if d.eval_path else []
        note(f"reward model: {len(self.train_pairs)} train / {len(self.eval_pairs)} held-out pairs")
        pg, _ = RunPlacement(cfg).role("reward_model")
        self.group = WorkerGroup("reward_model", cfg, backend=cfg.cluster.backend, trainable=True, value_head=True,
                                 placement_group=pg)
        self.group.call("setup")
        from megarl.metrics_sinks import build_sinks

        self.logger = MetricsLogger(None, cfg.trainer.total_steps, cfg.logging.progress_bar,
                                    sinks=build_sinks(cfg, self.out))

    def encode(self, pairs: list[Any]):
        """Pair i -> sequences 2i (chosen) and 2i+1 (rejected), each ``prompt + response``: scored at
        the response's last token, as HF's sequence classifiers pool (last non-pad token)."""
        from megarl.data import encode_prompt
        from megarl.data.batch import TokenBatch

        prompts, responses = [], []
        for pair in pairs:
            prompt = encode_prompt(self.tokenizer, pair.prompt, chat_template=self.cfg.data.chat_template,
                                   system_prompt=self.cfg.data.system_prompt)
            for response in (pair.chosen, pair.rejected):
                prompts.append(prompt)
                responses.append(self.tokenizer(response, add_special_tokens=False)["input_ids"])
        return TokenBatch.from_sequences(prompts, responses)

    def evaluate(self) -> dict[str, float]:
        if not self.eval_pairs:
            return {}
        batch = self.encode(self.eval_pairs)
        scores = self.group.forward("compute_scores", batch)["scores"]
        margin = scores[0::2] - scores[1::2]
        return {"eval/pair_accuracy": float((margin > 0).float().mean()), "eval/margin_mean": float(margin.mean())}

    def train_step(self, batch: Any) -> dict[str, float]:
        """One optimizer step on all pairs of ``batch``: data-parallel shards and micro-batches cut
        along pairs, one shard per data-parallel group."""
        num_pairs = len(batch) // 2
        return self.group.train(batch, [list(range(num_pairs))], [{"num_pairs": float(num_pairs)}], None, (), pairs=True)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        results: dict[str, Any] = {"steps": []}
        try:
            self.setup()
            results["eval_before"] = self.evaluate()
            note(f"eval before: {results['eval_before']}")
            order: list[int] = []
            epoch = 0
            per_step = min(cfg.batch.global_batch_size, len(self.train_pairs))
            for step in range(cfg.trainer.total_steps):
                if len(order) < per_step:
                    perm = torch.randperm(len(self.train_pairs), generator=torch.Generator().manual_seed(cfg.seed + epoch))
                    order += perm.tolist()
                    epoch += 1
                chosen, order = order[:per_step], order[per_step:]
                t = time.time()
                batch = self.encode([self.train_pairs[i] for i in chosen])
                metrics = self.train_step(batch)
                metrics = {f"rm/{k}": v for k, v in metrics.items()}
                metrics["time/step_s"] = time.time() - t
                results["steps"].append(metrics)
                self.logger.log(step + 1, metrics, console=(step + 1) % cfg.logging.log_interval == 0)
            results["eval_after"] = self.evaluate()
            self.logger.log(cfg.trainer.total_steps, results["eval_after"], console=False)
            note(f"eval after: {results['eval_after']}")
            cls = json.loads((self.model_dir / "config.json").read_text())["architectures"][0]
            cls = cls.replace("ForCausalLM", "ForSequenceClassification")
            results["export"] = str(export_hf_folder(
                self.group, self.model_dir, self.out / "hf_export",
                {"architectures": [cls], "num_labels": 1, "pad_token_id": self.tokenizer.pad_token_id
                 if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id}))
            return results
        finally:
            if self.logger is not None:
                self.logger.close()
            if self.group is not None:
                self.group.shutdown()
            RunPlacement.shutdown(cfg)
