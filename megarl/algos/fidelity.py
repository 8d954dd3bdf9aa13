"""Calibrated rollout-vs-trainer logprob checks (pure functions, no megatron, no HTTP).

Rollout and trainer compute the same model with different kernels (KV-cached decode vs full
forward, other GEMM tilings and reduction orders). In bf16 that alone moves token logprobs by a
few hundredths: measured on SmolLM2-135M-Instruct with its real weights (mean |logprob difference|
on the same sampled tokens, H200; benchmarks/bench_fidelity.py):

* HF bf16 full forward vs HF fp32: 3.1e-2; megatron bf16 (megarl) vs HF fp32: 3.0e-2;
* megarl's embedded engine (bf16) vs the megatron trainer (bf16): 3.7e-2;
* HF fp32 KV-cached ``generate`` vs its fp32 full forward: 5e-6.

So a fixed bound cannot serve every dtype: 2e-2 fails a correct bf16 run at step 0, while a bound
of 0.1 would hide a broken fp32 run. A wrong or mis-named weight moves logprobs by order 1 (on
real weights; ``tests/test_fidelity.py`` measures it), far above any floor here. The step-0 bound
is therefore ``margin * floor(trainer dtype, rollout dtype)``, where a pair's floor combines the
two sides' floors as independent errors (``sqrt(a**2 + b**2)``: bf16/bf16 = 4.2e-2, which covers
the measured 3.7e-2; bf16/fp32 = 3.0e-2, measured 3.0e-2 and 3.1e-2).

Block-FP8 rollout weights (``+fp8_block``) add their own floor, ~0.12: the bound becomes ~0.36-0.39,
still below a swapped weight pair (0.67 on the same run).

float16 was not measured: its floor is the bf16 floor scaled by the mantissa (10 bits vs 7 bits,
1/8). Measured on random weights, floors look ~5x lower (near-uniform outputs hide the noise):
calibrate on real weights only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

FP8_BLOCK_FLOOR = 0.12  # measured: see "fp8_block" below

# mean |logprob difference| between an implementation in this dtype and an exact (fp32) one, on
# real weights: the numbers above (benchmarks/bench_fidelity.py).
NOISE_FLOOR: dict[str, float] = {
    "float32": 1e-5,
    "bfloat16": 3e-2,
    "float16": 3e-2 / 8,
    # block-FP8 weights (e4m3, one scale per 128x128 block, `megarl convert hf-to-fp8`) against the
    # exact weights, SmolLM2-135M-Instruct's real weights, tokens sampled from the FP8 model:
    # fp32 compute on CPU 0.139 (468 tokens); on the H200 the FP8 engine (bf16) vs the bf16 megatron
    # trainer 0.117 (2560 tokens; bf16 engine vs megatron 0.039 in the same run, so FP8 alone ~0.11;
    # a swapped o_proj pair there: 0.67). bench_fidelity.py --fp8
    "fp8_block": FP8_BLOCK_FLOOR,
}
# bound = DEFAULT_MARGIN * floor: headroom over the measured floor for longer sequences, other
# models and other kernels (SGLang's), still two orders of magnitude below a wrong weight.
DEFAULT_MARGIN = 3.0


@dataclass(frozen=True)
class LogprobBound:
    """The step-0 bound and where it came from (for the log line and the metrics)."""

    bound: float
    floor: float                 # combined noise floor of the pair (0 when the bound was given)
    trainer_dtype: str
    rollout_dtype: str
    calibrated: bool             # False: rollout.logprob_diff_bound was set explicitly

    def describe(self) -> str:
        pair = f"trainer {self.trainer_dtype} / rollout {self.rollout_dtype}"
        if not self.calibrated:
            return f"rollout.logprob_diff_bound = {self.bound:.3g} (set in the config; {pair})"
        return (f"calibrated bound {self.bound:.3g} = {DEFAULT_MARGIN:g} x noise floor {self.floor:.3g} of "
                f"{pair} (rollout.logprob_diff_bound: null)")


def noise_floor(trainer_dtype: str, rollout_dtype: str) -> float:
    """Combined mean-|logprob diff| floor of two implementations in these dtypes. A side may name
    several independent sources joined by ``+`` (``bfloat16+fp8_block``: block-FP8 weights
    computed in bf16)."""
    parts = []
    for side in (trainer_dtype, rollout_dtype):
        for name in side.split("+"):
            if name not in NOISE_FLOOR:
                raise ValueError(f"no noise floor for dtype {name!r} (known: {sorted(NOISE_FLOOR)})")
            parts.append(NOISE_FLOOR[name])
    return math.hypot(*parts)


def logprob_bound(trainer_dtype: str, rollout_dtype: str, explicit: Optional[float] = None,
                  margin: float = DEFAULT_MARGIN) -> LogprobBound:
    """The bound the step-0 check uses: ``explicit`` when given, else ``margin * noise_floor``."""
    if explicit is not None:
        return LogprobBound(float(explicit), 0.0, trainer_dtype, rollout_dtype, calibrated=False)
    floor = noise_floor(trainer_dtype, rollout_dtype)
    return LogprobBound(margin * floor, floor, trainer_dtype, rollout_dtype, calibrated=True)


def mean_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, max) of ``|a - b|`` over the tokens ``mask`` marks (padding never counts)."""
    m = mask.bool()
    diff = torch.where(m, (a.float() - b.float()).abs(), torch.zeros((), dtype=torch.float32))
    return float(diff.sum() / m.sum().clamp(min=1)), float(diff.max()) if diff.numel() else 0.0


class LogprobMismatch(RuntimeError):
    """Rollout and trainer disagree on the sampled tokens' logprobs: wrong weights or naming."""


def rollout_logprob_check(step: int, trainer_lp: torch.Tensor, rollout_lp: torch.Tensor,
                          loss_mask: Optional[torch.Tensor], bound: LogprobBound,
                          enforce: Optional[bool] = None) -> tuple[dict[str, float], Optional[str]]:
    """Rollout vs trainer logprobs of the sampled tokens (flat, response tokens; of an agent
    trajectory only the model's, ``loss_mask``): metrics, and where the check is enforced (``enforce``,
    default: at step 0) the report line naming the bound and the noise floor it came from; there a
    mean difference above ``bound`` raises :class:`LogprobMismatch`: the servers do not hold the
    trainer's weights."""
    mean, worst = mean_abs_diff(trainer_lp, rollout_lp, torch.ones_like(trainer_lp) if loss_mask is None else loss_mask)
    out = {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": worst}
    if not (step == 0 if enforce is None else enforce):
        return out, None
    out.update({"rollout/logprob_diff_bound": bound.bound, "rollout/logprob_noise_floor": bound.floor})
    if mean > bound.bound:
        raise LogprobMismatch(
            f"step {step}: mean |rollout - trainer| logprob = {mean:.4g} exceeds the {bound.describe()}: the "
            f"rollout servers do not hold the trainer's weights (wrong checkpoint, naming or dtype); a "
            f"correct run differs by about the noise floor, a wrong weight by order 1")
    return out, (f"step {step}: mean |rollout - trainer| logprob = {mean:.3g} (max {worst:.3g}) within the "
                 f"{bound.describe()}")
