"""End-to-end RL loop on CPU: real megatron ranks (local and Ray), real embedded rollout server,
real tensorboard files, checkpoints and resume."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from megarl.trainer import LogprobMismatch, Trainer
from tests.helpers.runs import tiny_model, tiny_run_config



@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_grpo_three_steps_tensorboard_checkpoint_export(model, tmp_path):
    cfg = tiny_run_config(model, tmp_path / "run", "checkpoint.interval=2", "logging.profile_steps=[2]",
                          "logging.profile_phases=[train, sync]")
    results = Trainer(cfg).run()
    assert len(results["steps"]) == 3
    # torch.profiler ran around exactly the asked phases of step 2: a table and a loadable trace each
    profiles = tmp_path / "run" / "profile"
    assert sorted(p.name for p in profiles.iterdir()) == [
        "step_2_sync.json.gz", "step_2_sync.txt", "step_2_train.json.gz", "step_2_train.txt"]
    assert "aten::mm" in (profiles / "step_2_train.txt").read_text()   # the actor's matmuls, forward and backward
    with gzip.open(profiles / "step_2_train.json.gz", "rt") as f:
        assert any(e.get("name") == "aten::mm" for e in json.load(f)["traceEvents"])
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    for key in ("reward/mean", "reward/std", "response/length_mean", "actor/pg_loss", "actor/clip_frac",
                "actor/entropy", "actor/grad_norm", "rollout/logprob_diff_mean", "rollout/logprob_diff_max",
                "time/rollout_s", "time/train_s", "throughput/rollout_tokens_per_s", "sync/bytes",
                "sync/seconds", "eval/reward_mean"):
        assert key in scalars, key
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3]
    # the rewards are not constant, so the policy gradient did something
    assert any(abs(v) > 0 for _, v in scalars["actor/grad_norm"])
    # rollout and trainer agree on the sampled tokens' logprobs (same weights, pushed each step)
    assert max(v for _, v in scalars["rollout/logprob_diff_mean"]) < 1e-4
    # weights moved: the actor's later steps sample from updated policies
    assert scalars["sync/bytes"][0][1] > 1e6
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_000002", "step_000003"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp*"))
    # the HF export loads in transformers and differs from the start (it was trained)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(results["export"]).eval()
    start = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    ids = torch.tensor([[1, 20, 300, 4000, 50]])
    with torch.no_grad():
        delta = (exported(ids).logits - start(ids).logits).abs().max().item()
    assert 0 < delta < 10


def test_rollout_old_logprobs_skip_the_old_logprob_pass_after_the_step0_check(model, tmp_path):
    """algorithm.old_logprobs: rollout (slime's --use-rollout-logprobs): the actor's forward pass
    before training runs at step 0 only (the fidelity check), and the PPO ratio's old logprobs are
    the servers' own: the loss sees no rollout-vs-old difference (with recompute it sees the
    trainer's numerics against the server's)."""
    common = ("algorithm.old_logprobs=rollout", "checkpoint.interval=2", "checkpoint.export_hf=false",
              "trainer.eval_before_after=false")
    cfg = tiny_run_config(model, tmp_path / "run", "trainer.total_steps=2", *common)
    Trainer(cfg).run()
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in scalars["time/old_logprobs_s"]] == [1]          # step 0's check only
    assert [s for s, _ in scalars["rollout/logprob_diff_mean"]] == [1]
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2]
    assert all(v == 0.0 for _, v in scalars["actor/rollout_logprob_diff_mean"])
    assert any(abs(v) > 0 for _, v in scalars["actor/grad_norm"])
    # a resumed run checks again at its first step, bound enforced: the ratio rests on the servers
    resumed = Trainer(tiny_run_config(model, tmp_path / "run", "trainer.total_steps=3", "checkpoint.resume=auto",
                                      *common)).run()["steps"]
    assert len(resumed) == 1
    assert "time/old_logprobs_s" in resumed[0] and "rollout/logprob_diff_bound" in resumed[0]


def test_ppo_critic_reference_kl_with_ray(model, tmp_path):
    cfg = tiny_run_config(model, tmp_path / "ppo", "cluster.backend=ray", "algorithm.advantage=gae",
                          "critic.enabled=true", "ref.enabled=true", "algorithm.kl.mode=reward",
                          "algorithm.kl.coef=0.05", "rollout.n_per_prompt=2", "batch.global_batch_size=8",
                          "critic.optim.lr=1e-3", "checkpoint.export_hf=false", "trainer.eval_before_after=false",
                          "trainer.total_steps=2")
    results = Trainer(cfg).run()
    steps = results["steps"]
    assert len(steps) == 2
    for m in steps:
        assert math.isfinite(m["critic/vf_loss"]) and m["critic/vf_loss"] > 0
        assert "kl/actor_ref_k1" in m
    # step 1 runs before any update: actor == reference, so their KL is exactly zero
    assert abs(steps[0]["kl/actor_ref_k1"]) < 1e-6
    # after updates the actor has moved away from the reference
    assert abs(steps[1]["kl/actor_ref_k1"]) > 1e-7
    scalars = read_scalars(tmp_path / "ppo" / "tensorboard")
    assert "critic/vf_loss" in scalars and "kl/coef" in scalars


def test_actor_tp2_first_step_equals_tp1(model, tmp_path):
    common = ("trainer.total_steps=1", "checkpoint.export_hf=false", "trainer.eval_before_after=false")
    tp1 = Trainer(tiny_run_config(model, tmp_path / "tp1", *common)).run()["steps"][0]
    tp2 = Trainer(tiny_run_config(model, tmp_path / "tp2", *common, "cluster.backend=ray", "actor.gpus=2",
                                  "actor.parallel.tp=2", "actor.micro_batch_size=4")).run()["steps"][0]
    assert tp1["reward/mean"] == tp2["reward/mean"]  # identical rollouts (seeded per sample)
    for key in ("actor/pg_loss", "actor/loss", "actor/entropy", "actor/grad_norm"):
        assert abs(tp1[key] - tp2[key]) < 1e-4, (key, tp1[key], tp2[key])


def test_step0_fails_loudly_when_rollout_weights_differ(model, tmp_path, monkeypatch):
    from tests.helpers.servers import ServerProcess
    from tests.helpers.models import make_tiny_chat_model

    other = make_tiny_chat_model(tmp_path / "other", seed=7)
    monkeypatch.setattr("megarl.sync.rank.RankSender.push", lambda *a, **k: {})  # a broken sync
    with ServerProcess(str(other), extra=["--skip-tokenizer-init"]) as server:
        cfg = tiny_run_config(model, tmp_path / "bad", f"rollout.server_urls=[{server.url}]",
                              "trainer.eval_before_after=false")
        with pytest.raises(LogprobMismatch, match="rollout.logprob_diff_bound"):
            Trainer(cfg).run()


def test_megarl_eval_cli_scores_a_model(model, tmp_path, capsys):
    """`megarl eval` serves a model greedily on the held-out split and reports reward and accuracy."""
    import json

    from megarl.cli import main
    from tests.helpers.runs import ARCH_FROM_CONFIG_JSON, DEFAULT

    args = ["eval", str(DEFAULT), f"model.hf_path={model}", f"output_dir={tmp_path / 'ev'}", "data.num_eval=6",
            "data.num_train=16", "rollout.sampling.max_new_tokens=5", "reward.kind=function",
            "reward.function=tests.helpers.rewards:distinct_token_reward", *ARCH_FROM_CONFIG_JSON, "--model", str(model)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/response_length"] == 5.0  # greedy, a random model never stops early
    assert result["eval/reward_mean"] > 0 and result["eval/accuracy"] == 0.0
    with pytest.raises(SystemExit):  # argparse error naming --model
        main(["eval", str(DEFAULT), *ARCH_FROM_CONFIG_JSON, f"model.hf_path={model}", "--model", str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err


def test_sigusr1_checkpoints_after_the_current_step_and_stops(model, tmp_path, monkeypatch):
    """SLURM's time-limit warning: the run stops early with a checkpoint that resume picks up."""
    import os
    import signal

    import megarl.trainer as trainer_module

    real_step = trainer_module.Trainer.step

    def step_then_signal(self, step):
        metrics = real_step(self, step)
        if step == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return metrics

    monkeypatch.setattr(trainer_module.Trainer, "step", step_then_signal)
    cfg = tiny_run_config(model, tmp_path / "usr1", "trainer.total_steps=5", "checkpoint.interval=0",
                          "trainer.eval_before_after=false", "checkpoint.export_hf=false")
    results = Trainer(cfg).run()
    assert results["stopped_early"] == 1 and len(results["steps"]) == 1
    assert [p.name for p in (tmp_path / "usr1" / "checkpoints").glob("step_*")] == ["step_000001"]


def test_remax_uses_the_greedy_response_as_baseline(model, tmp_path):
    """Each sample's baseline is the reward of its prompt's greedy answer under the step's weights:
    checked against transformers' own greedy decoding of the same prompt tokens, scored by the
    run's reward function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.rewards import distinct_token_reward

    class Recording(Trainer):
        def setup_rollout(self, servers) -> None:
            super().setup_rollout(servers)
            baseline = self.rollout.greedy_baseline

            def recorded(samples):
                out = baseline(samples)
                self.seen = [(s.group, s.prompt_ids, float(b)) for s, b in zip(samples, out)]
                return out
            self.rollout.greedy_baseline = recorded

    cfg = tiny_run_config(model, tmp_path / "remax", "algorithm.advantage=remax", "trainer.total_steps=1",
                          "trainer.eval_before_after=false", "checkpoint.export_hf=false")
    trainer = Recording(cfg)
    step = trainer.run()["steps"][0]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    stop = sorted(set(cfg.rollout.sampling.stop_token_ids) | {tok.eos_token_id})
    expected = {}
    for group, prompt_ids, _ in trainer.seen:
        if group not in expected:
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt_ids]), do_sample=False, eos_token_id=stop, pad_token_id=stop[0],
                                  max_new_tokens=cfg.rollout.sampling.max_new_tokens)[0, len(prompt_ids):].tolist()
            expected[group] = distinct_token_reward(tok.decode(out, skip_special_tokens=True), None)
    assert len(expected) == cfg.batch.prompts_per_step
    assert [b for _, _, b in trainer.seen] == [pytest.approx(expected[g]) for g, _, _ in trainer.seen]
    assert step["remax/baseline_reward_mean"] == pytest.approx(sum(b for _, _, b in trainer.seen) / len(trainer.seen))
    assert math.isfinite(step["actor/pg_loss"])