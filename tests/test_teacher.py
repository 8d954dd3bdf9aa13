"""The distillation teacher: a Megatron role of its own network or servers scoring given tokens.

* The embedded server answers SGLang's input logprobs (``logprob_start_len``, ``max_new_tokens: 0``)
  with HF's numbers and SGLang's shape -- the shape checked against SGLang 0.5.23's own request
  parsing and scheduler code (in the CPU harness environment).
* A served teacher's logprobs equal the Megatron teacher's (fp32 on CPU) for a teacher whose shape
  is not the student's.
* The teacher must share the student's tokenizer: a mismatch is one line naming the field, before
  any worker starts; the rest of the teacher's validation, one field per line.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megarl.config import load_config, validate_config
from megarl.config.validate import collect_problems
from megarl.data.batch import TokenBatch
from megarl.engine.input_logprobs import input_token_logprobs
from megarl.rollout.client import RequestFailed, SGLangClient
from megarl.rollout.teacher import ServedTeacher, scoring_request
from megarl.wire import protocol
from tests.helpers.models import make_tiny_chat_model
from tests.helpers.runs import DEFAULT, tiny_overrides
from tests.helpers.servers import ServerProcess, make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
SEQS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [200, 100, 50, 25, 12, 6, 3, 1, 0, 9]]
STARTS = [2, 0, 6]


def hf_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``[len - 1]``: log p(ids[i] | ids[:i]) for i >= 1, fp32."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


# ----------------------------------------------------------------------------- the engine's input logprobs
def test_embedded_server_scores_given_tokens_as_sglang_answers(tmp_path):
    hf = make_tiny_hf_model(str(tmp_path / "m"), "qwen3", std=0.3)

    async def ask(url):
        async with SGLangClient(url) as c:
            scored = await c.generate_raw(scoring_request(SEQS, [s + 1 for s in STARTS]))
            both = await c.generate_raw({"input_ids": SEQS[0], "return_logprob": True, "logprob_start_len": 0,
                                         "sampling_params": {"max_new_tokens": 3, "temperature": 0.7}})
            plain = await c.generate_raw({"input_ids": SEQS[0], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 0}})
            with pytest.raises(RequestFailed, match="logprob_start_len=8 is higher than the number of input tokens 7"):
                await c.generate_raw({"input_ids": SEQS[0], "return_logprob": True, "logprob_start_len": 8,
                                      "sampling_params": {"max_new_tokens": 0}})
            return scored, both, plain

    with ServerProcess(str(tmp_path / "m")) as server:
        scored, both, plain = asyncio.run(ask(server.url))
    for ids, start, item in zip(SEQS, STARTS, scored):
        entries = item["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == ids[start:] and entries[0][0] is None
        want = hf_token_logprobs(hf, ids)[start:]
        assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), want, atol=1e-5)
        assert item["output_ids"] == [] and item["meta_info"]["finish_reason"]["type"] == "length"
    # with generation too (temperature does not scale input logprobs); none without a start
    entries = both["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(SEQS[0]) and len(both["meta_info"]["output_token_logprobs"]) == 3
    assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), hf_token_logprobs(hf, SEQS[0]), atol=1e-5)
    assert "input_token_logprobs" not in plain["meta_info"]


def test_input_logprobs_of_a_tp2_server_equal_tp1(tmp_path):
    """Every TP rank runs the scoring forward in lockstep; rank 0's head answers."""
    make_tiny_hf_model(str(tmp_path / "m"), "llama", std=0.3)

    async def ask(url):
        async with SGLangClient(url) as c:
            return await c.generate_raw(scoring_request(SEQS, [s + 1 for s in STARTS]))

    scores = {}
    for tp in (1, 2):
        with ServerProcess(str(tmp_path / "m"), extra=["--tp-size", str(tp)]) as server:
            answer = asyncio.run(ask(server.url))
        scores[tp] = torch.tensor([e[0] for item in answer for e in item["meta_info"]["input_token_logprobs"][1:]])
    assert scores[1].numel() == sum(len(ids) - 1 - s for ids, s in zip(SEQS, STARTS))
    assert (scores[1] - scores[2]).abs().max().item() < 1e-5


def test_scoring_request_and_answer_shape_are_sglangs_own():
    """The scoring body uses SGLang's field names, SGLang's GenerateReqInput reads it per item (start,
    return_logprob, max_new_tokens 0), and SGLang's scheduler shapes the kernel's logprobs into the
    very list the embedded engine answers (its first entry None, one token id per position)."""
    from tests.sglang_cpu.server import sglang_cpu_python

    body = scoring_request(SEQS, [s + 1 for s in STARTS])
    assert set(body) <= set(protocol.GENERATE_REQ_FIELDS)
    assert set(body["sampling_params"]) <= set(protocol.SAMPLING_PARAMS_FIELDS)
    torch.manual_seed(0)
    token_lps = [(-torch.rand(len(ids) - 1 - s) * 5).tolist() for ids, s in zip(SEQS, STARTS)]
    # SGLang's kernel scores hidden states start .. len - 1 against the next ids, the last one a pad
    kernel = [lps + [-9.0] for lps in token_lps]
    code = """
import json, sys
from types import SimpleNamespace
import tests.sglang_cpu.stubs as stubs; stubs.install()
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor
body, kernel = json.loads(sys.argv[1]), json.loads(sys.argv[2])
obj = GenerateReqInput(**body)
obj.normalize_batch_and_arguments()
items = [obj[i] for i in range(obj.batch_size)]
proc = SchedulerLogprobResultProcessor(model_config=SimpleNamespace(vocab_size=1 << 20))
out = []
for it, lps in zip(items, kernel):
    req = SimpleNamespace(is_prefill_only=False, origin_input_ids=it.input_ids, logprob_start_len=it.logprob_start_len,
                          logprob=SimpleNamespace(input_token_logprobs_val=None, input_token_logprobs_idx=None))
    proc._process_input_token_logprobs(req, list(lps))
    out.append(dict(start=it.logprob_start_len, ret=it.return_logprob, max_new=it.sampling_params["max_new_tokens"],
                    val=req.logprob.input_token_logprobs_val, idx=req.logprob.input_token_logprobs_idx))
print(json.dumps(out))
"""
    run = subprocess.run([sglang_cpu_python(), "-c", code, json.dumps(body), json.dumps(kernel)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-2000:]
    sglang = json.loads(run.stdout.strip().splitlines()[-1])
    for ids, start, lps, theirs in zip(SEQS, STARTS, token_lps, sglang):
        assert (theirs["start"], theirs["ret"], theirs["max_new"]) == (start, True, 0)
        ours = input_token_logprobs(ids, start, lps)
        assert [e[0] for e in ours] == theirs["val"] and [e[1] for e in ours] == theirs["idx"]


# ----------------------------------------------------------------------------- served == Megatron
def test_served_teacher_equals_the_megatron_teacher(tmp_path):
    """A teacher wider and deeper than the student (hidden 96, 3 layers, 6 heads vs 64, 2, 4): the
    Megatron role's logprobs of given responses and the embedded server's agree to fp32's bound."""
    from megarl.workers.group import WorkerGroup

    student = make_tiny_chat_model(tmp_path / "student")
    teacher = make_tiny_chat_model(tmp_path / "teacher", hidden=96, layers=3, heads=6, kv_heads=2, seed=3)
    cfg = load_config(DEFAULT, tiny_overrides(student, tmp_path / "run", "teacher.enabled=true",
                                              f"teacher.model_path={teacher}"))
    assert (cfg.teacher.arch.hidden_size, cfg.teacher.arch.num_layers) == (96, 3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (9, 4, 15)]
    responses = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (6, 11, 1)]
    batch = TokenBatch.from_sequences(prompts, responses)
    group = WorkerGroup("teacher", cfg, backend="local", trainable=False, value_head=False)
    try:
        group.call("setup")
        megatron = group.forward("compute_logprobs", batch, False)["logprobs"]
    finally:
        group.shutdown()
    with ServerProcess(str(teacher)) as server:
        served_teacher = ServedTeacher([server.url], request_batch=2)
        try:
            served = served_teacher.logprobs(batch)
        finally:
            served_teacher.close()
    assert served.shape == megatron.shape == (18,)
    assert (served - megatron).abs().max().item() < 1e-4


# ----------------------------------------------------------------------------- tokenizer and validation
@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny")


def teacher_copy(student: Path, dest: Path, edit=None) -> Path:
    """A copy of the student's folder whose tokenizer ``edit(tokenizer)`` changed and saved."""
    shutil.copytree(student, dest)
    if edit is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(student))
        edit(tok)
        tok.save_pretrained(str(dest))
    return dest


def one_line_refusal(student: Path, teacher: Path, out: Path, capsys) -> str:
    from megarl.cli import main

    assert main(["train", str(DEFAULT), *tiny_overrides(student, out, "teacher.enabled=true",
                                                       f"teacher.model_path={teacher}")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (out / "logs").exists()   # refused before any server or worker started
    return err


def test_a_teacher_with_another_vocabulary_is_one_line(student, tmp_path, capsys):
    teacher = teacher_copy(student, tmp_path / "more_tokens", lambda tok: tok.add_tokens(["<teacher_only>"]))
    err = one_line_refusal(student, teacher, tmp_path / "run", capsys)
    assert "teacher.model_path: its tokenizer has 49153 tokens, the student's 49152" in err


def test_a_teacher_with_other_special_tokens_is_one_line(student, tmp_path, capsys):
    def other_eos(tok):
        tok.eos_token = "<|endoftext|>"
    teacher = teacher_copy(student, tmp_path / "other_eos", other_eos)
    err = one_line_refusal(student, teacher, tmp_path / "run", capsys)
    assert "teacher.model_path: special token eos_token is '<|im_end|>' for the student and '<|endoftext|>'" in err


def test_a_teacher_with_renumbered_tokens_is_one_line(student, tmp_path, capsys):
    teacher = teacher_copy(student, tmp_path / "renumbered")
    tj = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tj))
    err = one_line_refusal(student, teacher, tmp_path / "run", capsys)
    assert f"teacher.model_path: token {a!r} is id" in err or f"teacher.model_path: token {b!r} is id" in err


def test_the_same_tokenizer_in_another_folder_passes(student, tmp_path):
    teacher = teacher_copy(student, tmp_path / "same")
    cfg = load_config(DEFAULT, tiny_overrides(student, tmp_path / "run", "teacher.enabled=true",
                                              f"teacher.model_path={teacher}"))
    validate_config(cfg, check_paths=True)


def problems(student: Path, *overrides: str) -> list[str]:
    cfg = load_config(DEFAULT, tiny_overrides(student, Path("/tmp/unused"), *overrides), validate=False)
    return collect_problems(cfg)


def test_teacher_validation_names_the_field(student):
    teacher = f"teacher.model_path={student}"
    on = "teacher.enabled=true"
    cases = {
        "teacher.model_path:": [on],
        "teacher.server_urls:": [on, teacher, "teacher.mode=served"],
        "teacher.gpus:": [on, teacher, "teacher.gpus=2", "cluster.backend=ray"],
        "teacher.parallel.tp:": [on, teacher, "teacher.parallel.tp=3", "teacher.gpus=3", "actor.gpus=3",
                                 "cluster.backend=ray"],
        "teacher.offload.optimizer:": [on, teacher, "teacher.offload.optimizer=true"],
        "teacher.arch.vocab_size:": [on, "teacher.model_path=/nowhere", "teacher.arch.vocab_size=1000"],
        "teacher.enabled:": ["algorithm.distill.coef=2"],
        "algorithm.distill.coef:": [on, teacher, "algorithm.distill.coef=0", "algorithm.distill.reward_weight=0"],
        "algorithm.old_logprobs:": [on, teacher, "algorithm.old_logprobs=rollout", "rollout.sampling.temperature=0.7"],
    }
    for field, overrides in cases.items():
        found = problems(student, *overrides)
        assert any(p.startswith(field) for p in found), (field, found)
    assert problems(student, on, teacher) == []
    assert problems(student, on, teacher, "teacher.mode=served", "teacher.server_urls=[http://127.0.0.1:1]") == []


# ----------------------------------------------------------------------------- memory plan
def test_the_plan_counts_the_teachers_own_network():
    """The recipe's Qwen3-8B teacher at tp 2, by hand: per layer q/o 2 x 4096 x 32 x 128, k/v 2 x 4096 x 8
    x 128 and the MLP 3 x 4096 x 12288 split over tp, two norms of 4096 on every rank; embedding and
    (untied) output layer 151936 x 4096 split over tp; the final norm. bf16, frozen: params only."""
    from megarl.planning.memory import GIB, make_plan

    recipe = ROOT / "recipes" / "qwen3-1.7b-opd-qwen3-8b.yaml"
    h, layers, vocab = 4096, 36, 151936
    per_layer = (2 * h * 32 * 128 + 2 * h * 8 * 128 + 3 * h * 12288) // 2 + 2 * h
    by_hand = layers * per_layer + 2 * vocab * h // 2 + h
    plan = make_plan(load_config(recipe))
    t = plan.roles["teacher"]
    assert (t.params_on_gpu, t.params, t.grads, t.optimizer, t.layout) == (by_hand, 2 * by_hand, 0, 0, "tp2 pp1 dp4")
    assert plan.roles["actor"].params_on_gpu < by_hand / 2             # the student is the small one
    phases = {p.name: p for p in plan.phases}
    assert phases["forward:teacher"].parts["teacher state"] == t.params
    assert "teacher resident" not in phases["rollout"].parts           # offloaded outside its pass
    assert plan.host["teacher offloaded (params)"] == 8 * t.params
    kept = make_plan(load_config(recipe, ["teacher.offload.params=false"]))
    rollout = {p.name: p for p in kept.phases}["rollout"]
    assert rollout.parts["teacher resident"] == t.params and rollout.total - phases["rollout"].total == t.params
    assert plan.fits and t.params / GIB > 7
