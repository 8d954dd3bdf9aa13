"""``reward.kind: judge``: the judge's prompt and grade (text side), a judge server that times out,
fails or answers garbage gives failed samples -- never zeros -- and the advantage of the rest of
the group is computed without them; a 2-step CPU GRPO run graded by a real embedded judge server."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megarl.algos import get_advantage_estimator
from megarl.config.schema import JudgeConfig, RunConfig
from megarl.data.records import PromptRecord
from megarl.rewards.failures import Failure
from megarl.rewards.judge import DEFAULT_TEMPLATE, ScoreParser, UnparsableGrade, make_parser, prompt_text, render
from megarl.rollout.client import LoopThread
from megarl.rollout.failures import failure_metrics, valid_mask
from megarl.rollout.judge import JudgeScorer
from megarl.rollout.pipeline import SampleScorer
from megarl.rollout.sample import Sample
from tests.helpers.http import serve
from tests.helpers.judge import StubJudge, make_sharp_judge
from tests.helpers.runs import tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


# ---------------------------------------------------------------------------------------------- text side
@pytest.mark.unit
def test_template_placeholders_are_replaced_literally():
    body = render("Q: {prompt}\nA: {response}\nRef: {reference}", "f(x) = {x}", "\\boxed{\\frac{1}{2}} {prompt}", None)
    # braces in the prompt or response are text, and a placeholder inside the response is not replaced
    assert body == "Q: f(x) = {x}\nA: \\boxed{\\frac{1}{2}} {prompt}\nRef: (none given)"
    default = render(None, "2+2?", "4", 4)
    assert default.startswith(DEFAULT_TEMPLATE.split("{prompt}")[0]) and "2+2?" in default and "Score: N" in default
    assert prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]) == "hi"
    assert prompt_text([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}]) == "user: a\n\nassistant: b\n\nuser: c"


@pytest.mark.unit
def test_score_parser_reads_the_last_grade_or_refuses():
    parse = make_parser(JudgeConfig())
    assert parse("reasoning... Score: 3\nwait, Score: 7") == 0.7
    assert parse("score=10") == 1.0 and parse("Score: 0") == 0.0
    for garbage in ("looks right to me", "Score: 11", "Score: -1", ""):
        with pytest.raises(UnparsableGrade):
            parse(garbage)
    assert ScoreParser(r"(\d)/5", 1, 5)("4/5") == 0.75
    assert make_parser(JudgeConfig(parser="tests.helpers.judge:digest_grade"))("abc") in [i / 10 for i in range(11)]


@pytest.mark.unit
def test_validation_names_each_wrong_judge_field():
    from megarl.config import load_config
    from megarl.config.loader import ConfigError
    from tests.helpers.runs import DEFAULT

    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, ["reward.kind=judge", "reward.judge.template=grade this", "reward.judge.score_pattern=Score",
                              "reward.judge.score_range=[10, 0]", "reward.judge.timeout_s=0", "reward.retries=-1",
                              "reward.judge.parser=score"])
    fields = sorted(p.split(":")[0] for p in err.value.problems)
    assert fields == ["reward.judge.model_path", "reward.judge.score_pattern", "reward.judge.score_range",
                      "reward.judge.template", "reward.judge.timeout_s", "reward.retries"], err.value.problems
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, ["reward.kind=judge", "reward.judge.server_url=judge:30000", "reward.judge.parser=nope",
                              "cluster.device=cpu", "reward.judge.devices=[0]"])
    assert sorted(p.split(":")[0] for p in err.value.problems) == [
        "reward.judge.parser", "reward.judge.server_url", "reward.judge.tokenizer"], err.value.problems
    ok = load_config(DEFAULT, ["reward.kind=judge", "reward.judge.server_url=http://judge:30000",
                               "reward.judge.tokenizer=/models/judge"])
    assert ok.reward.judge.parser == "score" and ok.reward.max_failed_steps == 3


def test_sglang_parses_the_judge_server_command(tmp_path):
    """A judge megarl starts with SGLang: its flags, parsed by SGLang 0.5.23's own parser -- the
    judge's checkpoint loaded (not dummy weights), token ids in and out, TP over its devices, the key
    from the 0600 file."""
    import json
    import subprocess

    from megarl.config import load_config
    from megarl.rollout.judge_server import judge_server_args
    from megarl.rollout.launch import sglang_key_file_text
    from tests.helpers.runs import DEFAULT, ROOT
    from tests.sglang_cpu.server import harness_env, sglang_cpu_python

    key_file = tmp_path / "judge.yaml"
    key_file.write_text(sglang_key_file_text("judge-key-0"))
    gpu = load_config(DEFAULT, ["cluster.device=cuda", "cluster.gpus_per_node=8", "rollout.gpus=1", "reward.kind=judge",
                                "reward.judge.model_path=/models/judge", "reward.judge.engine=sglang",
                                "reward.judge.devices=[6, 7]", "reward.judge.context_length=8192"])
    cpu = load_config(DEFAULT, ["reward.kind=judge", "reward.judge.model_path=/models/judge",
                                "reward.judge.engine=sglang"])
    cases = [judge_server_args(c, "/models/judge", "127.0.0.1", 30123, str(key_file)) for c in (gpu, cpu)]
    script = ("import json, sys\nimport tests.sglang_cpu  # noqa: F401\n"
              "from sglang.srt.server_args import prepare_server_args\n"
              "print(json.dumps([{k: getattr(prepare_server_args(a), k) for k in ('model_path', 'tp_size', "
              "'load_format', 'skip_tokenizer_init', 'api_key', 'context_length', 'port', 'device')} "
              "for a in json.load(sys.stdin)]))")
    done = subprocess.run([sglang_cpu_python(), "-c", script], input=json.dumps(cases), capture_output=True,
                          text=True, env=harness_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    on_gpu, on_cpu = json.loads(done.stdout.strip().splitlines()[-1])
    assert on_gpu["model_path"] == "/models/judge" and on_gpu["tp_size"] == 2 and on_gpu["load_format"] == "auto"
    assert on_gpu["skip_tokenizer_init"] and on_gpu["api_key"] == "judge-key-0" and on_gpu["context_length"] == 8192
    assert on_gpu["port"] == 30123 and on_cpu["device"] == "cpu" and on_cpu["tp_size"] == 1
    assert all("--api-key" not in c for c in cases)


# ---------------------------------------------------------------------------------------------- stub servers
def _answer(prompt: str) -> str | None:
    """The stub judge's answer to a rendered judge prompt, by what the graded response says."""
    if "SLOW" in prompt:
        return None                       # never answers
    if "BOOM" in prompt:
        return "HTTP 500"
    if "GARBAGE" in prompt:
        return "The response is great, well done."
    grade = prompt.split("Response:\n", 1)[1].split()[0]   # the response starts with its intended grade
    return f"Justification.\nScore: {grade}"


@pytest.fixture
def stub(tokenizer):
    loop = LoopThread()
    judge = StubJudge(tokenizer, _answer)
    runner, port = loop.run(serve(judge.handle))
    judge.url = f"http://127.0.0.1:{port}"
    yield judge
    judge.closing = True
    loop.run(runner.cleanup())
    loop.close()


def _samples(texts: list[str], groups: list[int]) -> list[Sample]:
    return [Sample(PromptRecord(f"question {g}", "42"), g, [1, 2], [3, 4, 5], [-0.5] * 3, "stop", text=t)
            for t, g in zip(texts, groups)]


def test_timeouts_errors_and_garbage_fail_samples_and_the_rest_of_the_group_is_graded(stub, tokenizer):
    cfg = RunConfig()
    # a deadline no answering request misses on a loaded machine; only the one that never answers does
    j = JudgeConfig(server_url=stub.url, timeout_s=2.0, batch_size=1, max_concurrency=8, context_length=1024,
                    chat=False)
    judge = JudgeScorer(j, stub.url, None, tokenizer, retries=1)
    texts = ["8 right", "SLOW answer", "2 wrong", "GARBAGE", "BOOM", "5 half", "9 a", "1 b"]
    groups = [0, 0, 0, 0, 0, 1, 1, 1]
    samples = _samples(texts, groups)
    try:
        SampleScorer(cfg, judge)(samples)
    finally:
        judge.close()
    rewards = [s.reward for s in samples]
    assert rewards[0] == 0.8 and rewards[2] == 0.2 and rewards[5:] == [0.5, 0.9, 0.1]
    reasons = [s.failure.reason if s.failed else None for s in samples]
    assert reasons == [None, "judge_timeout", None, "judge_unparsable", "judge_http_error", None, None, None]
    assert all(math.isnan(rewards[i]) for i in (1, 3, 4))          # failed: no reward, never 0
    assert "reward.judge.timeout_s = 2s" in samples[1].failure.message
    assert "great, well done" in samples[3].failure.message
    # each request failed for the stub's reasons was tried twice (retries=1); a garbage answer is not retried
    assert judge.requests == 6 + 2 + 2
    assert failure_metrics(samples) == {"reward/failed_frac": 3 / 8, "reward/failed": 3.0,
                                        "reward/failed_by_reason/judge_http_error": 1.0,
                                        "reward/failed_by_reason/judge_timeout": 1.0,
                                        "reward/failed_by_reason/judge_unparsable": 1.0}
    # the advantage of the group's other samples is computed without the failed ones
    mask = torch.ones(8, 3, dtype=torch.float64)
    adv, _ = get_advantage_estimator("grpo")(torch.tensor(rewards, dtype=torch.float64), mask,
                                             group_ids=torch.tensor(groups), valid=valid_mask(samples))
    mean0, std0 = 0.5, torch.tensor([0.8, 0.2], dtype=torch.float64).std().item()
    mean1, std1 = 0.5, torch.tensor([0.5, 0.9, 0.1], dtype=torch.float64).std().item()
    expected = [(0.8 - mean0) / (std0 + 1e-6), 0.0, (0.2 - mean0) / (std0 + 1e-6), 0.0, 0.0,
                (0.5 - mean1) / (std1 + 1e-6), (0.9 - mean1) / (std1 + 1e-6), (0.1 - mean1) / (std1 + 1e-6)]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float64).unsqueeze(-1).expand(8, 3))


def test_a_batched_request_past_its_deadline_fails_each_of_its_samples(stub, tokenizer):
    j = JudgeConfig(server_url=stub.url, timeout_s=1.5, batch_size=4, context_length=1024, chat=False)
    judge = JudgeScorer(j, stub.url, None, tokenizer)
    try:
        got = judge.score(["3 a", "SLOW", "4 b", "5 c", "6 d"], [PromptRecord("q", None)] * 5)
        too_long = judge.score(["7 " + "word " * 2000], [PromptRecord("q", None)])
    finally:
        judge.close()
    assert [g.reason if isinstance(g, Failure) else g for g in got] == ["judge_timeout"] * 4 + [0.6]
    assert stub.requests == 2
    assert too_long[0].reason == "judge_prompt_too_long"


def test_an_unreachable_judge_fails_samples(tokenizer):
    from megarl.wire.addresses import free_port

    url = f"http://127.0.0.1:{free_port()}"
    judge = JudgeScorer(JudgeConfig(server_url=url, timeout_s=2, chat=False), url, None, tokenizer)
    try:
        got = judge.score(["1 a"], [PromptRecord("q", None)])
    finally:
        judge.close()
    assert got[0].reason == "judge_unreachable"


# ---------------------------------------------------------------------------------------------- a real run
@pytest.mark.e2e
def test_grpo_graded_by_an_embedded_judge_server(model, tmp_path):
    """Two CPU GRPO steps whose rewards come from a judge model served by ``megarl serve`` (started by
    megarl from reward.judge.model_path); the parser reads the judge's greedy answer
    deterministically and leaves a third of the answers without a grade: those samples fail."""
    from megarl.trainer import Trainer

    judge_model = make_sharp_judge(tmp_path.parent / "sharp_judge", model)
    cfg = tiny_run_config(model, tmp_path / "run", "trainer.total_steps=2", "trainer.eval_before_after=false",
                          "checkpoint.export_hf=false", "checkpoint.final=false", "reward.kind=judge",
                          f"reward.judge.model_path={judge_model}", "reward.judge.max_new_tokens=6",
                          "reward.judge.context_length=1024", "reward.judge.batch_size=4",
                          "reward.judge.parser=tests.helpers.judge:digest_grade_or_unparsable")
    trainer = Trainer(cfg)
    results = trainer.run()
    steps = results["steps"]
    assert len(steps) == 2
    for m in steps:
        assert 0 < m["reward/failed_frac"] < 1, m["reward/failed_frac"]
        assert m["reward/failed_by_reason/judge_unparsable"] == m["reward/failed"]
        assert 0.0 <= m["reward/mean"] <= 1.0 and "reward/all_failed_step" not in m
    assert any(m["actor/grad_norm"] > 0 for m in steps)       # graded samples carried a signal
    log = (tmp_path / "run" / "logs" / "judge_server.log").read_text()
    assert f"ready ({judge_model}" in log                      # megarl serve, on the judge's own checkpoint
    # scored group by group as each finishes generating: 2 steps x 4 groups, one request of 4 samples each
    assert trainer.rollout.scorer.pool.requests == 2 * 4
    assert trainer.rollout.scorer.pool.server.host.proc is None  # stopped with the run
