"""On-policy distillation end to end on CPU: a student (a tiny chat model with noise added) samples,
a teacher (the model without the noise) scores the student's tokens, and the per-token reverse KL is
the only advantage (reward_weight 0). The reverse KL to the teacher falls over 10 steps; a served
teacher (the embedded server scoring given tokens) gives the Megatron teacher's numbers."""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.trainer import Trainer
from tests.helpers.models import make_distill_pair
from tests.helpers.runs import tiny_run_config
from tests.helpers.servers import ServerProcess

STEPS = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_distill_pair(tmp_path_factory.mktemp("distill"))


def distill_config(student: Path, teacher: Path, out: Path, *overrides: str):
    return tiny_run_config(student, out, "teacher.enabled=true", f"teacher.model_path={teacher}",
                           "algorithm.distill.reward_weight=0", "algorithm.distill.baseline=batch_mean",
                           "trainer.eval_before_after=false", "checkpoint.final=false", "checkpoint.export_hf=false",
                           "logging.sinks=[]", *overrides)


@pytest.fixture(scope="module")
def megatron_run(pair, tmp_path_factory) -> list[dict[str, float]]:
    teacher, student = pair
    cfg = distill_config(student, teacher, tmp_path_factory.mktemp("opd") / "run", f"trainer.total_steps={STEPS}")
    return Trainer(cfg).run()["steps"]


def test_reverse_kl_to_the_teacher_falls_over_ten_steps(megatron_run):
    kl = [m["distill/reverse_kl"] for m in megatron_run]
    assert len(kl) == STEPS
    for m in megatron_run:   # logged every step, with the teacher's own phase
        assert {"distill/reverse_kl_k3", "distill/teacher_logprob_mean", "distill/student_logprob_mean",
                "time/teacher_logprobs_s"} <= set(m)
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert kl[0] > 1.0, kl                       # the noise made the student differ from the teacher
    assert last < 0.85 * first, kl               # and distillation pulled it back


def test_a_served_teacher_gives_the_megatron_teachers_numbers(pair, megatron_run, tmp_path):
    """Step 1 of both runs samples the same tokens (same seed, same student): the teacher's logprobs
    of them, from the embedded server's input logprobs or the Megatron role, agree to fp32's bound."""
    teacher, student = pair
    with ServerProcess(str(teacher)) as server:
        cfg = distill_config(student, teacher, tmp_path / "served", "trainer.total_steps=1", "teacher.mode=served",
                             f"teacher.server_urls=[{server.url}]")
        served = Trainer(cfg).run()["steps"][0]
    ref = megatron_run[0]
    assert served["distill/student_logprob_mean"] == ref["distill/student_logprob_mean"]   # the same samples
    for key in ("distill/teacher_logprob_mean", "distill/reverse_kl"):
        assert abs(served[key] - ref[key]) < 1e-4, (key, served[key], ref[key])
