"""The distillation teacher (``teacher.*``, ``algorithm.distill``): what makes a teacher usable.

Why a module of its own: the teacher is the one role whose network is not the student's. Its shape
(``teacher.arch``) comes from its own config.json and drives its parallel checks and its memory
plan; its tokenizer must be the student's, or the log-probabilities it gives "the same token ids"
would be of other text. Both are decided here, before any worker starts: the shape with the rest
of validation, the tokenizer at launch (``megarl train``), where the model folders are at hand.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from megarl.config.schema import DistillConfig, ModelArch, RunConfig

SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def role_arch(cfg: RunConfig, role: str) -> ModelArch:
    """The network a Megatron role builds: the teacher's own, every other role's the policy's."""
    return cfg.teacher.arch if role == "teacher" else cfg.model.arch


def resolve_teacher_arch(cfg: RunConfig, problems: list[str]) -> None:
    """Fill ``teacher.arch`` from ``teacher.model_path``'s config.json where readable (as
    ``model.arch`` is filled from ``model.hf_path``); a recipe value that disagrees is an error."""
    from megarl.config.validate import fill_arch, hf_mapping_refusals

    found = fill_arch(cfg.teacher.arch, cfg.teacher.model_path or "", "teacher.arch", "teacher.model_path", problems)
    if found is not None and cfg.teacher.mode == "megatron":   # megarl builds it: it must map exactly
        path, hf = found
        problems.extend(f"teacher.model_path: {path}: {line}" for line in hf_mapping_refusals(hf))


def teacher_problems(cfg: RunConfig) -> list[str]:
    """One line per problem with the teacher and ``algorithm.distill`` (no files read but config.json)."""
    from megarl.config.validate import _check_parallel, _check_role_cp_budget

    t, d = cfg.teacher, cfg.algorithm.distill
    problems: list[str] = []
    if not t.enabled:
        if d != DistillConfig():
            problems.append("teacher.enabled: algorithm.distill is set but there is no teacher (teacher.enabled=true, "
                            "teacher.model_path)")
        return problems
    if cfg.trainer.mode != "rl":
        problems.append(f"teacher.enabled: a teacher scores an RL step's samples; trainer.mode is {cfg.trainer.mode!r}")
    if not t.model_path:
        problems.append("teacher.model_path: the teacher's HF folder is needed (its tokenizer is checked against the "
                        "student's; mode megatron loads its weights)")
    resolve_teacher_arch(cfg, problems)
    if d.coef < 0 or d.reward_weight < 0:
        field = "coef" if d.coef < 0 else "reward_weight"
        problems.append(f"algorithm.distill.{field}: must be >= 0, got {getattr(d, field)}")
    elif d.coef == 0 and d.reward_weight == 0:
        problems.append("algorithm.distill.coef: coef and reward_weight are both 0: the advantage would be 0 everywhere")
    temperature = cfg.rollout.sampling.temperature
    if cfg.algorithm.old_logprobs == "rollout" and temperature != 1.0:
        problems.append(f"algorithm.old_logprobs: 'rollout' makes the servers' logprobs at temperature {temperature} "
                        f"the student's side of the reverse KL, the teacher's are at 1; use recompute (or "
                        f"rollout.sampling.temperature=1)")
    s, a = cfg.model.arch, t.arch
    if s.vocab_size and a.vocab_size and a.vocab_size < s.vocab_size:
        problems.append(f"teacher.arch.vocab_size: the teacher has {a.vocab_size} token rows, the student "
                        f"{s.vocab_size}: the student can sample ids the teacher cannot score")
    if t.lora.rank:
        problems.append(f"teacher.lora.rank: LoRA is for the actor only, got {t.lora.rank}")
    if t.mode == "served":
        if not t.server_urls:
            problems.append("teacher.server_urls: mode 'served' needs running teacher servers (SGLang or `megarl "
                            "serve --model-path TEACHER`)")
        if t.request_batch < 1:
            problems.append(f"teacher.request_batch: must be >= 1, got {t.request_batch}")
        return problems
    if t.server_urls:
        problems.append("teacher.server_urls: set, but teacher.mode is 'megatron' (set teacher.mode=served to use them)")
    _check_parallel("teacher", t, a, cfg.cluster.device, False, problems)
    _check_role_cp_budget(cfg, "teacher", problems)
    for kind in ("grads", "optimizer"):
        if getattr(t.offload, kind):
            problems.append(f"teacher.offload.{kind}: a frozen role holds no {kind}; only offload.params applies")
    if cfg.cluster.backend == "local" and t.gpus > 1:
        problems.append(f"cluster.backend: local runs one rank per role, teacher.gpus = {t.gpus}; use "
                        f"cluster.backend=ray (or teacher.gpus=1)")
    if cfg.placement.mode == "colocated" and t.gpus != cfg.actor.gpus:
        problems.append(f"teacher.gpus: colocated pools must be equal; actor.gpus = {cfg.actor.gpus}, "
                        f"teacher.gpus = {t.gpus}")
    elif cfg.placement.mode == "disaggregated" and t.gpus > cfg.actor.gpus:
        problems.append(f"teacher.gpus: the teacher runs in the actor's pool (between the actor's passes); "
                        f"actor.gpus = {cfg.actor.gpus}, teacher.gpus = {t.gpus}")
    return problems


def teacher_path_problems(cfg: RunConfig) -> list[str]:
    """At launch: the teacher's folder exists and its tokenizer is the student's."""
    t = cfg.teacher
    if not t.enabled or not t.model_path:
        return []
    from megarl.config.validate import hf_config_path

    if not t.model_path.startswith("builtin:") and hf_config_path(t.model_path) is None:
        return [f"teacher.model_path: no config.json in {t.model_path!r}"]
    problem = tokenizer_mismatch(cfg.model.tokenizer or cfg.model.hf_path, t.model_path)
    return [f"teacher.model_path: {problem}"] if problem else []


def tokenizer_mismatch(student: str, teacher: str) -> Optional[str]:
    """Why the teacher's tokenizer is not the student's, or None: the same token -> id map (added
    tokens included) and the same special tokens. Byte-equal tokenizer files settle it without
    loading either; otherwise both are loaded (transformers) and compared."""
    s_dir, t_dir = _folder(student), _folder(teacher)
    if _same_files(s_dir, t_dir):
        return None
    from transformers import AutoTokenizer

    s_tok, t_tok = AutoTokenizer.from_pretrained(str(s_dir)), AutoTokenizer.from_pretrained(str(t_dir))
    s_vocab, t_vocab = s_tok.get_vocab(), t_tok.get_vocab()
    where = f"the student's ({s_dir}) and the teacher's ({t_dir})"
    if len(s_vocab) != len(t_vocab):
        return f"its tokenizer has {len(t_vocab)} tokens, the student's {len(s_vocab)}: {where} must be one tokenizer"
    for token, sid in s_vocab.items():
        tid = t_vocab.get(token)
        if tid != sid:
            return (f"token {token!r} is id {sid} in the student's tokenizer and "
                    f"{'missing' if tid is None else f'id {tid}'} in the teacher's: {where} must be one tokenizer")
    for name in SPECIAL:
        a, b = getattr(s_tok, name, None), getattr(t_tok, name, None)
        if a != b:
            return f"special token {name} is {a!r} for the student and {b!r} for the teacher: {where} must agree"
    return None


def _folder(path: str) -> Path:
    """A model folder, ``builtin:smollm2-135m-instruct`` included (its cached HF folder)."""
    if path == "builtin:smollm2-135m-instruct":
        from megarl.checkpoint.smollm2 import smollm2_hf_dir

        return Path(smollm2_hf_dir())
    return Path(path).expanduser()


def _same_files(a: Path, b: Path) -> bool:
    """Both folders hold tokenizer.json and tokenizer_config.json with the same bytes."""
    names = ("tokenizer.json", "tokenizer_config.json")
    return all((a / n).is_file() and (b / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def served_teacher_key(cfg: Any) -> Optional[str]:
    """The served teacher's API key (``teacher.api_key_env``), or None when the variable is unset."""
    import os

    name = cfg.teacher.api_key_env
    return os.environ.get(name) or None if name else None
