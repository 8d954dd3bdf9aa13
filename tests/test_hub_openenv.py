"""The OpenEnv hub adapter (``megarl.envs.hubs.openenv_hub``): a published OpenEnv environment
trained unchanged.

The environment (``tests/helpers/openenv_envs.py``) is written against openenv-core's public API
and served by openenv's own app on 127.0.0.1, reached through the WebSocket protocol openenv's own
client speaks. What is held to what:

* the reward megarl gets is what the environment itself gives for the model's replies -- stepping
  the environment class directly with the same messages (no server, no adapter) is the reference;
* every turn is one recorded gateway call, and the observation reached the model's prompt;
* concurrent trajectories play episodes of their own (their resets must meet at a barrier, and a
  shared instance would end one episode after three steps of both);
* a server that is down or raises fails the sample (nan, ``agent_error``), never a 0;
* a 2-step GRPO run of ``recipes/smollm2-135m-grpo-openenv-cpu.yaml`` trains on the rewards.
"""
from __future__ import annotations

import json
import math
import threading

import pytest

from megarl.data.records import PromptRecord
from megarl.envs.hubs import HUBS
from megarl.envs.hubs import openenv_hub
from megarl.rollout.byo_agent import ByoAgentRollout, ByoSettings
from megarl.rollout.call_session import CallLimits
from tests.helpers.openenv_envs import TURNS, WordLengthEnv, openenv_server, reference_episode
from tests.test_gateway import EOS, SAMPLING, ScriptedManager, tok  # noqa: F401 - tok is a fixture

ENTRY = "megarl.envs.hubs.openenv_hub:run"


@pytest.fixture(scope="module")
def env_url():
    with openenv_server(max_sessions=16) as url:
        yield url


def episode_records(*seeds: int) -> list[PromptRecord]:
    return [PromptRecord("", metadata={"openenv": {"seed": s, "reset": {}}}, index=i) for i, s in enumerate(seeds)]


def rollout_for(manager, tok, **entry_args) -> ByoAgentRollout:  # noqa: F811 - tok is the fixture's value
    settings = ByoSettings(ENTRY, "hermes", CallLimits(TURNS + 1, 400, 12, 1024), 60.0, 8,
                           entrypoint_args=entry_args)
    return ByoAgentRollout(manager, SAMPLING, tok, settings, None)


def test_reward_is_the_environments_and_every_turn_is_recorded(tok, env_url):  # noqa: F811
    replies = ["cat", "planet", "hi"]
    turns = [(tok.encode(w, add_special_tokens=False) + [EOS], "stop") for w in replies]
    assert [tok.decode(ids[:-1]) for ids, _ in turns] == replies
    manager = ScriptedManager({0: list(turns)})
    WordLengthEnv.instances.clear()
    rollout = rollout_for(manager, tok, env_url=env_url)
    try:
        samples = rollout.generate(episode_records(7), 1)
        session = rollout.sessions[0]
    finally:
        rollout.close()
        manager.close()
    assert len(WordLengthEnv.instances) == 1                          # one episode on the server
    want, done = reference_episode(7, replies)
    assert len(want) == TURNS and done and len(set(want)) > 1        # three turns, not all the same reward
    (smp,) = samples
    assert not smp.failed and smp.reward == pytest.approx(sum(want))
    assert len(session.server_ids) == TURNS and len(manager.log) == TURNS   # one recorded call per turn
    assert [o for _, o in manager.log] == [ids for ids, _ in turns]
    assert [i for i, m in zip(smp.response_ids, smp.loss_mask) if m] == sum((ids for ids, _ in turns), [])
    # each observation the environment gave was in the prompt of the call after it
    from tests.helpers.openenv_envs import SayAction

    ref = WordLengthEnv()
    asks = [ref.reset(seed=7).prompt] + [ref.step(SayAction(message=w)).prompt for w in replies[:-1]]
    for (prompt_ids, _), ask in zip(manager.log, asks):
        assert tok.decode(prompt_ids).rstrip().endswith(f"{ask}<|im_end|>\n<|im_start|>assistant")


def test_final_reward_and_json_actions(tok, env_url):  # noqa: F811
    """``reward: final`` returns the last step's reward; ``action_format: json`` reads the reply as
    the action object, and a reply that is no action ends the episode with ``invalid_action_reward``."""
    good = json.dumps({"message": "abcd"})
    script = {0: [(tok.encode(w, add_special_tokens=False) + [EOS], "stop") for w in ("cat", "planet", "hi")],
              1: [(tok.encode(good, add_special_tokens=False) + [EOS], "stop"),
                  (tok.encode("not json", add_special_tokens=False) + [EOS], "stop")]}
    manager = ScriptedManager({0: script[0]})
    rollout = rollout_for(manager, tok, env_url=env_url, reward="final")
    try:
        (final,) = rollout.generate(episode_records(7), 1)
    finally:
        rollout.close()
        manager.close()
    assert final.reward == pytest.approx(reference_episode(7, ["cat", "planet", "hi"])[0][-1])
    manager = ScriptedManager({0: script[1]})
    rollout = rollout_for(manager, tok, env_url=env_url, action_format="json", invalid_action_reward=-1.0)
    try:
        (smp,) = rollout.generate(episode_records(11), 1)
    finally:
        rollout.close()
        manager.close()
    assert not smp.failed and len(manager.log) == 2
    assert smp.reward == pytest.approx(reference_episode(11, ["abcd"])[0][0] - 1.0)


def test_concurrent_trajectories_get_episodes_of_their_own(tok, env_url):  # noqa: F811
    """Four trajectories at once, two seeds: every reset waits for all four sessions (a shared or
    serialized session breaks the barrier and fails the samples), and each reward is its own seed's."""
    words = ["ab", "abcdef", "abcd"]
    scripts = {j: [(tok.encode(w, add_special_tokens=False) + [EOS], "stop") for w in words] for j in range(4)}
    manager = ScriptedManager(scripts)
    WordLengthEnv.instances.clear()
    WordLengthEnv.barrier = threading.Barrier(4, timeout=20)
    rollout = rollout_for(manager, tok, env_url=env_url)
    try:
        samples = rollout.generate(episode_records(1, 2), 2)
        episodes = list(WordLengthEnv.instances)
    finally:
        WordLengthEnv.barrier = None
        rollout.close()
        manager.close()
    assert not any(s.failed for s in samples), [s.failure for s in samples]
    want = {seed: sum(reference_episode(seed, words)[0]) for seed in (1, 2)}
    assert want[1] != want[2]                     # the two seeds' episodes differ for these replies
    assert [s.reward for s in samples] == pytest.approx([want[1], want[1], want[2], want[2]])
    assert len(episodes) == len(set(episodes)) == 4
    assert len(manager.log) == sum(len(reference_episode(s, words)[0]) for s in (1, 1, 2, 2))


def test_a_one_session_server_serves_trajectories_in_turn(tok):  # noqa: F811
    """A server left at openenv's default of one session answers a second one CAPACITY_REACHED; the
    adapter asks again until the session is free, so three trajectories at once all play their episode."""
    words = ["abc", "abcdefg", "ab"]
    manager = ScriptedManager({j: [(tok.encode(w, add_special_tokens=False) + [EOS], "stop") for w in words]
                               for j in range(3)})
    with openenv_server(max_sessions=1) as url:
        rollout = rollout_for(manager, tok, env_url=url)
        try:
            samples = rollout.generate(episode_records(4), 3)
        finally:
            rollout.close()
            manager.close()
    assert not any(s.failed for s in samples), [s.failure for s in samples]
    assert [s.reward for s in samples] == pytest.approx([sum(reference_episode(4, words)[0])] * 3)


def test_environment_down_or_raising_fails_the_sample(tok, env_url):  # noqa: F811
    import socket

    with socket.socket() as s:                    # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases = [({"env_url": dead}, "cannot reach"),
             ({"env_url": env_url}, "the environment broke"),
             ({"env_url": env_url, "observation_field": "nope"}, "observation_field")]
    WordLengthEnv.explode_on = "boom"
    try:
        for args, words in cases:
            manager = ScriptedManager({0: [(tok.encode("boom", add_special_tokens=False) + [EOS], "stop")] * TURNS})
            rollout = rollout_for(manager, tok, **args)
            try:
                (smp,) = rollout.generate(episode_records(3), 1)
            finally:
                rollout.close()
                manager.close()
            assert smp.failed and math.isnan(smp.reward), (args, smp.reward)
            assert smp.failure.reason == "agent_error" and words in smp.failure.message, smp.failure
    finally:
        WordLengthEnv.explode_on = None


def test_in_process_environment_and_bad_arguments(tok):  # noqa: F811
    """``environment: module:Class`` is served by openenv's app in this process; bad arguments are
    one-line errors naming the field."""
    manager = ScriptedManager({0: [(tok.encode(w, add_special_tokens=False) + [EOS], "stop") for w in ("a", "b", "c")]})
    rollout = rollout_for(manager, tok, environment="tests.helpers.openenv_envs:WordLengthEnv")
    try:
        (smp,) = rollout.generate(episode_records(5), 1)
    finally:
        rollout.close()
        manager.close()
    assert not smp.failed and smp.reward == pytest.approx(sum(reference_episode(5, ["a", "b", "c"])[0]))
    bad = [({}, "exactly one"), ({"env_url": "x", "environment": "m:C"}, "exactly one"),
           ({"env_url": "localhost"}, "must be a URL"), ({"env_url": "http://h", "reward": "max"}, "sum or final"),
           ({"environment": "tests.helpers.openenv_envs:TURNS"}, "not an openenv Environment")]
    for args, words in bad:
        with pytest.raises(ValueError) as err:
            openenv_hub.run("http://unused", "k", {"prompt": ""}, **args)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_export_records_are_what_the_loader_reads(tmp_path):
    from megarl.data.sources import load_jsonl

    assert HUBS["openenv"] == openenv_hub.__name__
    out = tmp_path / "episodes.jsonl"
    n = openenv_hub.export_records(out, count=3, prompt="Play.", seed_start=10, reset={"level": 2},
                                   env_url="http://127.0.0.1:1")
    records = load_jsonl(out)
    assert n == 3 and [r.prompt for r in records] == ["Play."] * 3
    assert [openenv_hub._reset_args({"metadata": r.metadata}) for r in records] == [
        {"seed": s, "level": 2} for s in (10, 11, 12)]
    for bad, words in (({"count": 0}, "count"), ({"count": 1, "nope": 1}, "unknown arguments")):
        with pytest.raises(ValueError, match=words):
            openenv_hub.export_records(out, **bad)


@pytest.mark.e2e
def test_openenv_recipe_two_grpo_steps(tmp_path, env_url):
    """``recipes/smollm2-135m-grpo-openenv-cpu.yaml`` with the test's server and exported episodes:
    real megatron actor, real embedded server (a tiny random model with SmolLM2's tokenizer), the
    adapter as the agent. Every trajectory is a multi-turn episode with the environment's reward,
    and the step-0 logprob gate holds (the recorded tokens are the server's)."""
    from megarl.config import load_config
    from megarl.trainer import Trainer
    from tests.helpers.runs import ROOT, tiny_agent_overrides, tiny_model

    data = tmp_path / "episodes.jsonl"
    assert openenv_hub.export_records(data, count=8) == 8
    cfg = load_config(ROOT / "recipes" / "smollm2-135m-grpo-openenv-cpu.yaml", tiny_agent_overrides(
        tiny_model(tmp_path / "models"), tmp_path / "run", "trainer.total_steps=2", f"data.path={data}",
        f"agent.entrypoint_args.env_url={env_url}", "agent.tool_parser=hermes"))
    WordLengthEnv.instances.clear()
    trainer = Trainer(cfg)
    steps = trainer.run()["steps"]
    assert len(steps) == 2
    for m in steps:
        assert m["reward/failed_frac"] == 0.0
        assert m["agent/turns_mean"] > 1.0
    assert steps[0]["rollout/logprob_diff_mean"] < 1e-4
    assert any(abs(m["actor/grad_norm"]) > 0 for m in steps)
    assert len(WordLengthEnv.instances) == 2 * 2 * 4          # one episode per trajectory: steps x prompts x n
    last = [WordLengthEnv.log[e] for e in WordLengthEnv.instances[-8:]]       # the last step's episodes
    for episode in last:                   # what the server gave is what the environment gives for those replies
        assert len(episode["messages"]) == 3
        assert episode["rewards"] == pytest.approx(reference_episode(episode["seed"], episode["messages"])[0])
    sessions = list(trainer.rollout.agent.sessions)
    assert len(sessions) == 8 and all(s.joins.count("new") == 1 for s in sessions)   # one sample per trajectory
    sums = [sum(e["rewards"]) for e in last]
    assert steps[-1]["reward/mean"] == pytest.approx(sum(sums) / len(sums))
    assert steps[-1]["reward/std"] > 0                         # the environment's rewards differ within the step
