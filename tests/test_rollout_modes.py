"""``rollout.mode`` end to end on CPU: the real trainer (megatron actor in-process), the embedded
rollout server as its own process (placement disaggregated), weights pushed every step.

* ``sync`` through its rollout source gives exactly what the loop gave before sources existed
  (``RolloutPipeline.collect`` per step after each push), samples, metrics and checkpoint state alike;
* ``one_step_off``: batch k >= 1 comes entirely from version k - 1 (the push waits for the
  generation, nothing is interrupted);
* ``async`` with ``interrupt: abort``: pushes meet requests in flight, which come back with their
  tokens and are continued under the new version (mixed-version samples); every trained token is
  within ``max_staleness``, and tokens of the trainer's own version match its logprobs (the push
  reached the server);
* ``async`` with ``interrupt: retract``, killed with SIGKILL after a checkpoint and resumed with
  ``checkpoint.resume=auto``: every prompt drawn is trained on once, discarded (counted) or still
  pending -- none lost, none twice -- by the prompt ledger, and the servers kept requests across
  the pushes (mixed versions without client resubmission).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from megarl.rollout.ledger import read_ledger
from megarl.trainer import Trainer
from tests.helpers.runs import DEFAULT, ROOT, tiny_model, tiny_overrides, tiny_run_config

NUMERIC_SKIP = ("time/", "throughput/", "sync/seconds", "sync/bytes_per_s")
QUIET = ("checkpoint.export_hf=false", "trainer.eval_before_after=false", "logging.progress_bar=false")
# generation longer than a training step (2 requests at a time, 48 tokens each: ~2.7 s a batch alone
# on this machine, a tiny training step ~1.5 s): a push finds the next batch still generating, as
# rollout-bound runs do
SLOW_ROLLOUT = ("placement.mode=disaggregated", "rollout.sampling.max_new_tokens=48", "rollout.max_running_requests=2")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


def comparable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(NUMERIC_SKIP)}


# ---------------------------------------------------------------------------------------------
# sync == the loop before rollout sources
# ---------------------------------------------------------------------------------------------

class Recording(Trainer):
    """Records every batch the pipeline's ``collect`` returns (token ids, logprobs, rewards)."""

    def setup_rollout(self, servers) -> None:
        super().setup_rollout(servers)
        collect, self.batches = self.rollout.collect, []

        def recorded(loader, step: int):
            samples, metrics = collect(loader, step)
            self.batches.append([(s.group, s.prompt_ids, s.response_ids, s.rollout_logprobs, s.reward,
                                  s.finish_reason) for s in samples])
            return samples, metrics
        self.rollout.collect = recorded


class CollectEachStep:
    """The loop before rollout sources, as a stand-in source: ``collect(step)`` right after the
    previous push, the retried-requests count around it, nothing around a push, the loader's
    position as the only rollout state."""

    mode, off_policy = "sync", False

    def __init__(self, trainer: Trainer):
        self.t = trainer

    def next_batch(self, step: int) -> tuple[list[Any], dict[str, float]]:
        retried = self.t.rollout.manager.retried
        samples, metrics = self.t.rollout.collect(self.t.loader, step)
        metrics["rollout/retried_requests"] = self.t.rollout.manager.retried - retried
        return samples, metrics

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[dict[str, float]]:
        yield {}

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.t.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t.loader.load_state_dict(state["loader"])

    def close(self) -> None:
        pass


class PreSourceLoop(Recording):
    def make_source(self):
        return CollectEachStep(self)


def test_sync_source_equals_the_loop_before_sources(model, tmp_path):
    runs = {}
    for name, cls in (("source", Recording), ("before", PreSourceLoop)):
        trainer = cls(tiny_run_config(model, tmp_path / name, "rollout.mode=sync", *QUIET))
        runs[name] = (trainer, trainer.run()["steps"])
    (a, steps_a), (b, steps_b) = runs["source"], runs["before"]
    assert type(a.source).__name__ == "SyncSource" and len(steps_a) == len(steps_b) == 3
    assert a.batches == b.batches          # the same prompts, tokens, logprobs and rewards, step by step
    for ma, mb in zip(steps_a, steps_b):
        assert comparable(ma) == comparable(mb)
        assert not any(k.startswith("offpolicy/") for k in ma)
    state = lambda t: json.loads((t.ckpt_dir / "step_000003" / "trainer_state.json").read_text())  # noqa: E731
    assert state(a) == state(b)            # no rollout-source state beyond the loader's position


# ---------------------------------------------------------------------------------------------
# one_step_off, async (abort)
# ---------------------------------------------------------------------------------------------

class PushMidGeneration(Trainer):
    """Test instrumentation: a push first waits (up to 300 s, a hang guard) until some group is generating, and
    records whether one was, so that the pause is known to have met requests in flight."""

    def make_source(self):
        source = super().make_source()
        inner = source.weight_update
        self.pushed_mid_generation: list[bool] = []

        @contextlib.contextmanager
        def weight_update(version: int) -> Iterator[dict[str, float]]:
            with source.buffer.cond:
                self.pushed_mid_generation.append(bool(source.buffer.cond.wait_for(lambda: source.buffer.inflight, 300)))
            with inner(version) as stats:
                yield stats
        source.weight_update = weight_update
        return source


def check_offpolicy_step(step: int, m: dict[str, float], bound: int) -> None:
    """Invariants of every off-policy step: staleness within the bound, a push after it, and the
    tokens of the trainer's own version sampled by exactly its weights."""
    assert m["offpolicy/staleness_max"] <= bound, (step, m["offpolicy/staleness_max"])
    assert m["rollout/stale_groups_dropped"] == 0 and m["batch/samples"] == 16
    assert m["sync/bytes"] > 1e6                     # this step's update went to the server
    if "offpolicy/fresh_logprob_diff_mean" in m:     # fp32 on both sides: the noise floor is ~1e-6
        assert m["offpolicy/fresh_logprob_diff_mean"] < 1e-4, (step, m["offpolicy/fresh_logprob_diff_mean"])


def test_one_step_off_trains_each_batch_from_the_previous_version(model, tmp_path):
    cfg = tiny_run_config(model, tmp_path / "osf", "rollout.mode=one_step_off", "trainer.total_steps=3",
                          "placement.mode=disaggregated", *QUIET)
    steps = Trainer(cfg).run()["steps"]
    assert len(steps) == 3
    for k, m in enumerate(steps):
        check_offpolicy_step(k, m, bound=1)
        expected = 0.0 if k == 0 else 1.0            # batch k generated entirely by version k - 1
        assert m["offpolicy/staleness_mean"] == m["offpolicy/staleness_max"] == expected, (k, m)
        assert m["offpolicy/mixed_version_frac"] == 0 and m["rollout/resumed_requests"] == 0
    # the weights moved between versions: stale tokens' logprobs differ from the trainer's now
    assert all(m["offpolicy/stale_logprob_diff_mean"] > 1e-4 for m in steps[1:])


def test_one_step_off_with_rollout_old_logprobs_reports_staleness_without_a_trainer_pass(model, tmp_path):
    """algorithm.old_logprobs: rollout off-policy: the stale batch's own logprobs are the PPO
    ratio's denominator (the behaviour policy); staleness is still reported, the rollout-vs-trainer
    logprob comparison is not (no trainer pass ran to compare with)."""
    cfg = tiny_run_config(model, tmp_path / "osf_rollout_lp", "rollout.mode=one_step_off", "trainer.total_steps=2",
                          "placement.mode=disaggregated", "algorithm.old_logprobs=rollout", *QUIET)
    steps = Trainer(cfg).run()["steps"]
    assert [m["offpolicy/staleness_max"] for m in steps] == [0.0, 1.0]
    assert not any(k.endswith("logprob_diff_mean") and k.startswith("offpolicy/") for m in steps for k in m)
    assert all(m["actor/rollout_logprob_diff_mean"] == 0.0 for m in steps)


def test_async_abort_continues_requests_under_the_new_weights(model, tmp_path):
    cfg = tiny_run_config(model, tmp_path / "async", "rollout.mode=async", "rollout.max_staleness=1",
                          "rollout.interrupt=abort", "trainer.total_steps=3", *SLOW_ROLLOUT, *QUIET)
    trainer = PushMidGeneration(cfg)
    steps = trainer.run()["steps"]
    assert len(steps) == 3
    for k, m in enumerate(steps):
        check_offpolicy_step(k, m, bound=1)
    # push 1 (after step 0) and push 2 met requests in flight: aborted, answered with their tokens and
    # continued by the client under the new version -- step 2's batch (drawn under version 1) mixes 1 and 2
    assert trainer.pushed_mid_generation[:2] == [True, True], trainer.pushed_mid_generation
    assert sum(m["rollout/resumed_requests"] for m in steps) > 0
    assert steps[2]["offpolicy/mixed_version_frac"] > 0
    assert "offpolicy/fresh_logprob_diff_mean" in steps[2]   # version-2 tokens, checked against the trainer


# ---------------------------------------------------------------------------------------------
# async (retract) and one_step_off: SIGKILL after a checkpoint, every prompt once
# ---------------------------------------------------------------------------------------------

def run_killed_after_step_two_checkpoint(model: Path, tmp_path: Path, common: tuple[str, ...]) -> dict:
    """``megarl train`` SIGKILLed (its whole process group) once step 2's batch was taken after
    the step-2 checkpoint, so that batch is redone on resume; returns the checkpoint's source state."""
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "megarl", "train", str(DEFAULT), *tiny_overrides(model, out, *common)]
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    ledger, ckpt = out / "rollout_ledger.jsonl", out / "checkpoints" / "step_000002"
    # a hang guard (a dead run fails at once, below): the loop ends as soon as step 2 is reached; with
    # the cores hogged and other jobs on the box the whole test took 859 s (240 s was not enough)
    deadline = time.time() + 1800
    try:
        while not (ckpt.is_dir() and ledger.is_file() and '"step": 2' in ledger.read_text()):
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.time() < deadline, "the first run did not reach step 2"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)   # the servers follow their parent (parent-death signal)
        proc.wait()
    saved = json.loads((ckpt / "trainer_state.json").read_text())["rollout_source"]
    assert saved["version"] == 2 and saved["groups"], saved   # pending groups were checkpointed
    return saved


def check_each_prompt_once(out: Path, trainer: Trainer, saved: dict) -> None:
    """The ledger of the killed and the resumed run: steps 0-3 of 4 prompts, none trained on (or
    discarded) twice, and what was drawn is a prefix of the loader's order (nothing lost), the
    checkpointed pending groups among it."""
    account = read_ledger(out / "rollout_ledger.jsonl")   # the killed run's lines from step 2 on are superseded
    assert account.runs == 2 and sorted(account.steps) == [0, 1, 2, 3]
    assert all(len(v["trained"]) == 4 for v in account.steps.values())
    assert account.problems(len(trainer.train_records)) == [], "a prompt trained on (or discarded) twice"
    drawn = account.drawn + account.pending
    assert len(drawn) == len(set(drawn)), "a prompt was trained on (or discarded) twice"
    from megarl.data import PromptLoader

    stream = PromptLoader(trainer.train_records, 1, trainer.cfg.seed, trainer.cfg.data.shuffle)
    assert sorted(drawn) == sorted(stream.next_batch()[0].index for _ in range(len(drawn)))
    assert {g["record_index"] for g in saved["groups"]} <= set(drawn)


def test_async_run_killed_with_sigkill_resumes_without_losing_or_repeating_prompts(model, tmp_path):
    common = ("rollout.mode=async", "rollout.max_staleness=1", "rollout.interrupt=retract", "trainer.total_steps=4",
              "checkpoint.interval=2", *SLOW_ROLLOUT, *QUIET)
    saved = run_killed_after_step_two_checkpoint(model, tmp_path, common)
    resumed = PushMidGeneration(tiny_run_config(model, tmp_path / "killed", *common, "checkpoint.resume=auto"))
    steps = resumed.run()["steps"]
    assert len(steps) == 2                    # steps 2 and 3, from the checkpoint of step 2
    for k, m in zip((2, 3), steps):
        check_offpolicy_step(k, m, bound=1)
    check_each_prompt_once(tmp_path / "killed", resumed, saved)
    # retract: the server kept requests across the pushes (no client resubmission) and they continued
    # under the new version
    assert resumed.pushed_mid_generation == [True, True], resumed.pushed_mid_generation
    assert all(m["rollout/resumed_requests"] == 0 for m in steps)
    assert steps[1]["offpolicy/mixed_version_frac"] > 0


def test_one_step_off_run_killed_with_sigkill_resumes_without_losing_or_repeating_prompts(model, tmp_path):
    """one_step_off: the batch of step 3, generated while step 2 trained, is in the step-2 checkpoint
    (finished groups with their tokens, the rest as prompts); the resumed run trains every prompt once."""
    common = ("rollout.mode=one_step_off", "trainer.total_steps=4", "checkpoint.interval=2",
              "placement.mode=disaggregated", *QUIET)
    saved = run_killed_after_step_two_checkpoint(model, tmp_path, common)
    resumed = Trainer(tiny_run_config(model, tmp_path / "killed", *common, "checkpoint.resume=auto"))
    steps = resumed.run()["steps"]
    assert len(steps) == 2
    for k, m in zip((2, 3), steps):
        check_offpolicy_step(k, m, bound=1)
    check_each_prompt_once(tmp_path / "killed", resumed, saved)
