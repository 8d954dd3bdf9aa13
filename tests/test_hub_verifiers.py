"""The verifiers hub adapter (``megarl/envs/hubs/verifiers_hub.py``): a verifiers v1 environment,
unchanged, played by verifiers' own machinery against megarl's real gateway.

The environment is ``vf-say-word`` (``tests/helpers/vf_envs``, put on ``sys.path`` as an installed
hub package would be): offline, in-process harness, a lenient "reply with the word X" grader that
raises on ``BOOM``. What is held to what:

* the reward ``run`` returns is what verifiers' own scoring (``Task.score`` on a trace holding the
  same reply text) gives, and the gateway recorded the call: the server saw the task's prompt
  rendered by the chat template, the sample's sampled ids are the server's;
* an episode that errors inside verifiers is a failed sample (nan), never a 0;
* exported rows load through megarl's JSONL loader and ``run`` rebuilds exactly the taskset's tasks;
* the recipe trains two GRPO steps with the environment's rewards (tiny model, real embedded server,
  real megatron actor), its step-0 logprob check passing on the recorded tokens.
"""
from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import pytest

from megarl.data.sources import load_jsonl
from megarl.envs.entrypoint import EntrypointError, check_call, load_entrypoint
from megarl.envs.hubs import HUBS
from megarl.rollout.byo_agent import ByoAgentRollout, ByoSettings, record_dict
from megarl.rollout.call_session import CallLimits
from tests.test_gateway import EOS, SAMPLING, ScriptedManager, served, tok  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / "tests" / "helpers" / "vf_envs"
ENV = "vf-say-word"
ARGS = {"taskset": {"num_tasks": 4}}
ENTRY = "megarl.envs.hubs.verifiers_hub:run"


@pytest.fixture(autouse=True)
def installed_env(monkeypatch):
    """``vf-say-word`` importable, as ``pip install`` of a hub environment makes it."""
    monkeypatch.syspath_prepend(str(ENVS))


@pytest.fixture()
def hub():
    from megarl.envs.hubs import verifiers_hub

    return verifiers_hub


def exported(hub, tmp_path, env_args=ARGS):
    path = tmp_path / "vf.jsonl"
    n = hub.export_records(path, environment=ENV, env_args=env_args)
    return path, n


def reference_reward(task, reply: str) -> float:
    """verifiers' own scoring of ``reply`` for ``task``: ``Task.score`` on a trace whose reply it is."""
    import verifiers.v1 as vf

    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()), root_reply=reply)
    asyncio.run(task.score(trace))
    return trace.reward


def rollout_for(manager, tok, env_args=ARGS):
    settings = ByoSettings(ENTRY, "hermes", CallLimits(3, 200, 12, 512), 60.0, 4,
                           entrypoint_args={"environment": ENV, "env_args": env_args})
    return ByoAgentRollout(manager, SAMPLING, tok, settings, None)


def test_reward_is_the_environments_own_score_and_the_gateway_recorded_it(hub, tok, tmp_path):  # noqa: F811
    path, _ = exported(hub, tmp_path)
    recs = load_jsonl(path)[:2]                                     # words "yes", "hello"
    replies = ["Sure: yes", "hot"]
    scripts = {i: [(tok.encode(r, add_special_tokens=False) + [EOS], "stop")] for i, r in enumerate(replies)}
    manager = ScriptedManager(scripts)
    rollout = rollout_for(manager, tok)
    try:
        samples = rollout.generate(recs, 1, seed_base=1)
        sessions = list(rollout.sessions)
    finally:
        rollout.close()
        manager.close()
    assert len(samples) == 2 and not any(s.failed for s in samples)
    loaded = hub.load(ENV, ARGS)
    for rec, smp, reply in zip(recs, samples, replies):
        sampled = [i for i, m in zip(smp.response_ids, smp.loss_mask) if m]
        assert sampled == scripts[rec.index][0][0]                  # the server's ids, as sampled
        text = tok.decode(sampled, skip_special_tokens=True)
        assert text == reply
        task = loaded.task(record_dict(rec)["metadata"]["verifiers"])
        assert smp.reward == reference_reward(task, text)
    assert [s.reward for s in samples] == [1.0, 0.5 * 2 / 4]        # "hot" holds h, o of h, e, l, o
    # one call per trajectory, on the task's own prompt as the chat template renders it
    assert len(manager.log) == 2 and all(len(s.server_ids) == 1 for s in sessions)
    prompts = sorted(p for p, _ in manager.log)
    expected = sorted(list(tok.apply_chat_template(rec.prompt, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]) for rec in recs)
    assert prompts == expected
    assert sorted(s.prompt_ids for s in samples) == expected


def test_smollm2_on_the_real_server_scores_as_verifiers_scores(hub, served, tok, tmp_path):  # noqa: F811
    """SmolLM2-135M-Instruct behind the embedded server and the gateway: every trajectory's reward is
    verifiers' own score of the reply the server sampled."""
    path, _ = exported(hub, tmp_path)
    recs = load_jsonl(path)[1:2]                                    # "Reply with the word hello."
    rollout = rollout_for(served, tok)
    try:
        samples = rollout.generate(recs, 2, seed_base=7)
    finally:
        rollout.close()
    assert len(samples) == 2 and not any(s.failed for s in samples)
    loaded = hub.load(ENV, ARGS)
    for smp in samples:
        text = tok.decode([i for i, m in zip(smp.response_ids, smp.loss_mask) if m], skip_special_tokens=True)
        task = loaded.task(record_dict(smp.record)["metadata"]["verifiers"])
        assert smp.reward == reference_reward(task, text) and 0.0 <= smp.reward <= 1.0


def test_an_episode_that_errors_inside_verifiers_is_a_failed_sample(hub, tok, tmp_path):  # noqa: F811
    path, _ = exported(hub, tmp_path)
    rec = load_jsonl(path)[1]
    manager = ScriptedManager({0: [(tok.encode("BOOM", add_special_tokens=False) + [EOS], "stop")]})
    rollout = rollout_for(manager, tok)
    try:
        (smp,) = rollout.generate([rec], 1, seed_base=1)
    finally:
        rollout.close()
        manager.close()
    assert smp.failed and smp.failure.reason == "agent_error" and math.isnan(smp.reward)   # never a 0
    assert "verifiers episode failed" in smp.failure.message and "BOOM" in smp.failure.message
    # verifiers itself calls this episode failed: its scoring raises on the reply
    with pytest.raises(Exception, match="BOOM"):
        reference_reward(hub.load(ENV, ARGS).task(record_dict(rec)["metadata"]["verifiers"]), "BOOM")


def test_export_round_trip_rebuilds_the_tasksets_tasks(hub, tmp_path):
    import verifiers.v1 as vf

    path, n = exported(hub, tmp_path)
    recs = load_jsonl(path)                                         # megarl's own data loader
    tasks = list(vf.load_environment(vf.resolve_env_config({"taskset": {"id": ENV, **ARGS["taskset"]}})).taskset)
    assert n == len(recs) == len(tasks) == 4
    loaded = hub.load(ENV, ARGS)
    for rec, task in zip(recs, tasks):
        wire = record_dict(rec)["metadata"]["verifiers"]
        rebuilt = loaded.task(wire)
        assert type(rebuilt) is type(task) and rebuilt.data == task.data and rebuilt.key == task.key
        assert rec.prompt == [{"role": "system", "content": task.data.system_prompt},
                              {"role": "user", "content": task.data.prompt}]
    assert hub.export_records(tmp_path / "two.jsonl", environment=ENV, env_args=ARGS, limit=2) == 2
    # a record exported under other env_args does not silently become another task
    tampered = record_dict(recs[0])["metadata"]["verifiers"]
    tampered = {**tampered, "data": {**tampered["data"], "word": "nope"}}
    with pytest.raises(hub.HubError, match=r"^record\.metadata\.verifiers\.key: "):
        loaded.task(tampered)


def test_arguments_are_checked_with_one_line_errors(hub, tmp_path):
    assert HUBS["verifiers"] == hub.__name__
    fn = load_entrypoint(ENTRY)
    check_call(fn, {"environment": ENV, "env_args": ARGS})          # what validation does before a run
    with pytest.raises(EntrypointError, match="agent.entrypoint_args"):
        check_call(fn, {"environment": ENV, "envargs": ARGS})
    with pytest.raises(hub.HubError, match=r"^agent\.entrypoint_args\.environment: 'no-such-env-xyz'"):
        hub.run("http://127.0.0.1:1/v1", "k", {"metadata": {}}, environment="no-such-env-xyz")
    with pytest.raises(hub.HubError, match=r"^agent\.entrypoint_args\.env_args: ") as bad:
        hub.load(ENV, {"taskset": {"num_tasks": "many"}})
    assert "\n" not in str(bad.value) and "num_tasks" in str(bad.value)         # pydantic's report, one line
    with pytest.raises(hub.HubError, match=r"^record\.metadata\.verifiers: "):
        hub.run("http://127.0.0.1:1/v1", "k", {"prompt": "hi", "metadata": {}}, environment=ENV, env_args=ARGS)
    with pytest.raises(hub.HubError, match=r"^split: "):
        hub.export_records(tmp_path / "x.jsonl", environment=ENV, env_args=ARGS, split="eval")


def test_the_environment_loads_once_for_concurrent_trajectories(hub):
    args = {"taskset": {"num_tasks": 3}}
    got, barrier = [], threading.Barrier(6)

    def load():
        barrier.wait()
        got.append(hub.load(ENV, args))
    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 6 and all(g is got[0] for g in got)
    assert hub.load(ENV, {"taskset": {"num_tasks": 2}}) is not got[0]          # other arguments: another env


@pytest.mark.e2e
def test_verifiers_recipe_trains_two_grpo_steps(hub, tmp_path):
    """The recipe, shrunk to the tiny model: the environment's rewards drive two GRPO steps."""
    from megarl.config import load_config
    from megarl.trainer import Trainer
    from tests.helpers.runs import tiny_agent_overrides, tiny_model

    path, _ = exported(hub, tmp_path, {"taskset": {"num_tasks": 8}})
    model = tiny_model(tmp_path / "models")
    cfg = load_config(ROOT / "recipes" / "smollm2-135m-grpo-verifiers-cpu.yaml", tiny_agent_overrides(
        model, tmp_path / "run", "trainer.total_steps=2", f"data.path={path}", "agent.tool_parser=hermes"))
    assert cfg.agent.entrypoint == ENTRY and cfg.agent.entrypoint_args["environment"] == ENV
    trainer = Trainer(cfg)
    results = trainer.run()
    steps = results["steps"]
    assert len(steps) == 2
    for m in steps:
        assert m["reward/failed_frac"] == 0.0 and math.isfinite(m["reward/mean"])
        assert m["agent/turns_mean"] == 1.0                        # the environment's harness: one call
    assert steps[0]["rollout/logprob_diff_mean"] < 1e-4            # recorded ids are the server's (the gate)
    assert any(abs(m["actor/grad_norm"]) > 0 for m in steps)       # the lenient grader's rewards differ
    sessions = list(trainer.rollout.agent.sessions)
    assert sessions and all(len(s.server_ids) == 1 for s in sessions)
