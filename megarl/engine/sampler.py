"""Batched, seeded token sampling for the embedded engine: every row of a decode step in a fixed
number of tensor ops, whatever mix of parameters the rows have, with no host sync inside.

Why batched: the engine samples every running request each step; a per-request Python loop (one
generator, one `tolist` each) made rollout cost scale with the number of requests instead of the
number of tokens (a GRPO step's rollout on the H200 took 30.6 s that way, 1.5 s batched).

Semantics (unchanged from the per-request sampler this replaces):
* logprobs are `log_softmax(logits / T)` of the *unfiltered* distribution (raw logits for greedy
  rows), gathered at the chosen token -- SGLang's default `output_token_logprobs`;
* greedy rows (`temperature == 0` or `top_k == 1`) take `argmax(logits)`;
* other rows take Gumbel-max over their (filtered) temperature-scaled logprobs with noise from
  :func:`seeded_gumbel`, keyed by (request seed, number of tokens it has generated, token id):
  a seeded request samples the same tokens alone or in any batch, on any device.
Top-k / top-p / min-p keep-sets are computed with a stable sort, so ties are broken by token id
and a row's keep-set does not depend on the other rows of the batch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

log = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply, as in Wang/Mueller hashes) on int64 tensors whose
    values stay below 2^58, so the arithmetic is exact and identical on CPU and CUDA."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _hash32_i32(x: torch.Tensor) -> torch.Tensor:
    """`_hash32` on int32 tensors holding the 32-bit patterns: the same bits (the multiplications
    wrap modulo 2^32, the shifts are masked to be logical) with half the memory traffic and no
    masking op per round. Checked against `_hash32` once per device (`_fast_ok`)."""
    x = (((x >> 16) & 0xFFFF) ^ x) * 0x45D9F3B
    x = (((x >> 16) & 0xFFFF) ^ x) * 0x45D9F3B
    return ((x >> 16) & 0xFFFF) ^ x


_VOCAB_HASH: Dict[Tuple[int, str, torch.dtype], torch.Tensor] = {}
_FAST: Dict[str, bool] = {}


def _vocab_hash(vocab: int, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`_hash32(arange(vocab))`, computed once per (vocab, device, dtype): a third of the noise's
    integer work otherwise repeated every step."""
    key = (vocab, str(device), dtype)
    h = _VOCAB_HASH.get(key)
    if h is None:
        h = _VOCAB_HASH[key] = _hash32(torch.arange(vocab, device=device, dtype=torch.int64)).to(dtype)
    return h


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    return _hash32((_hash32(seeds & _MASK32) ^ ((steps * 0x27D4EB2D) & _MASK32)) & _MASK32)


def _gumbel_reference(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = _hash32(_row_keys(seeds, steps)[:, None] ^ _vocab_hash(vocab, seeds.device)[None, :])
    u = (bits.to(torch.float64) + 0.5) / 4294967296.0
    return -torch.log(-torch.log(u)).to(torch.float32)


def _gumbel_fast(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    key = _row_keys(seeds, steps).to(torch.int32)
    bits = _hash32_i32(key[:, None] ^ _vocab_hash(vocab, seeds.device, torch.int32)[None, :])
    u = bits.view(torch.uint32).to(torch.float64)
    # the reference's ops, in place: + 0.5, / 2^32, log, neg, log, neg (same values, fewer buffers)
    return u.add_(0.5).div_(4294967296.0).log_().neg_().log_().neg_().to(torch.float32)


def _fast_ok(device: torch.device) -> bool:
    """Does the int32 path give the reference's bits on this device (once per device)?"""
    ok = _FAST.get(str(device))
    if ok is None:
        g = torch.Generator().manual_seed(0)
        seeds = torch.randint(-2**40, 2**40, (8,), generator=g).to(device)
        steps = torch.randint(0, 1 << 20, (8,), generator=g).to(device)
        try:
            ok = bool(torch.equal(_gumbel_fast(seeds, steps, 4099), _gumbel_reference(seeds, steps, 4099)))
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _FAST[str(device)] = ok
    return ok


def seeded_gumbel(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise ``[B, V]`` that depends only on (request seed, decode step, token id): a
    seeded request samples the same tokens whether it is batched with others or alone, on any
    device, and without a per-request generator (the rows are sampled in one batched op)."""
    if _fast_ok(seeds.device):
        return _gumbel_fast(seeds, steps, vocab)
    return _gumbel_reference(seeds, steps, vocab)


def filtered_logp(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Rows ``logp [R, V]`` with the tokens that each row's top-k / top-p / min-p exclude set to
    -inf (``top_k <= 0`` or ``>= V``, ``top_p >= 1``, ``min_p <= 0``: that filter is off)."""
    R, V = logp.shape
    p = logp.exp()
    sp, si = torch.sort(p, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(p, dtype=torch.bool)
    k_on = (top_k > 0) & (top_k < V)
    kth = sp.gather(1, (top_k.clamp(1, V) - 1)[:, None])
    keep &= (p >= kth) | ~k_on[:, None]
    cum = torch.cumsum(sp, dim=-1)
    drop_sorted = ((cum - sp) > top_p[:, None] * cum[:, -1:]) & (top_p < 1.0)[:, None]
    keep &= ~torch.zeros_like(keep).scatter_(1, si, drop_sorted)
    keep &= (p >= min_p[:, None] * sp[:, :1]) | (min_p <= 0.0)[:, None]
    return torch.where(keep, logp, torch.full_like(logp, float("-inf")))


_FILTERS_OK: Dict[str, bool] = {}


def fused_filters_ok(device: torch.device) -> bool:
    """Do the Triton keep-set thresholds (`filter_kernels`) agree with `filtered_logp` on this
    device (checked once per device, outside any graph capture: the engine's graphs warm up eagerly
    first)? If they fail to build or disagree beyond a boundary id, filtered rows take the sort
    path and the log says so once -- a slow step, never a wrong or crashed one."""
    key = str(device)
    ok = _FILTERS_OK.get(key)
    if ok is None:
        try:
            from . import filter_kernels
            g = torch.Generator().manual_seed(0)
            logits = (torch.randn(4, 3000, generator=g) * 3).to(device)
            t = torch.tensor([1.0, 0.7, 1.3, 1.0], device=device)
            top_k = torch.tensor([0, 50, 0, 10], device=device)
            top_p = torch.tensor([0.9, 1.0, 0.8, 0.95], device=device)
            min_p = torch.tensor([0.0, 0.0, 0.02, 0.0], device=device)
            keep = (logits / t[:, None]) >= filter_kernels.filter_thresholds(logits, t, top_k, top_p, min_p)[:, None]
            want = torch.isfinite(filtered_logp(torch.log_softmax(logits / t[:, None], dim=-1), top_k, top_p, min_p))
            ok = int((keep != want).sum()) <= 2   # rounding may move an id on a boundary, no more
            why = "" if ok else f"{int((keep != want).sum())} of {keep.numel()} keep decisions differ"
        except Exception as e:   # noqa: BLE001 -- any failure to build or run means: do not use them
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            log.warning("top-k/top-p/min-p rows on %s use the sort-based sampler: the Triton thresholds "
                        "failed their check (%s)", key, why)
        _FILTERS_OK[key] = ok
    return ok


@dataclass
class RowParams:
    """Per-row sampling parameters of a batch, as tensors on the logits' device.

    ``temperature`` is 1.0 for greedy rows (their logprobs are of the raw logits); ``steps`` is
    the number of tokens each row has generated (the noise's step key)."""

    temperature: torch.Tensor   # [B] fp32
    greedy: torch.Tensor        # [B] bool
    seeds: torch.Tensor         # [B] int64
    steps: torch.Tensor         # [B] int64
    top_k: torch.Tensor         # [B] int64
    top_p: torch.Tensor         # [B] fp32
    min_p: torch.Tensor         # [B] fp32


def sample_rows(logits: torch.Tensor, rp: RowParams, any_stochastic: bool = True,
                filter_rows: Optional[torch.Tensor] = None, fused: bool = False,
                filter_all: bool = False,
                filter_kinds: Tuple[bool, bool, bool] = (True, True, True)) -> Tuple[torch.Tensor, torch.Tensor]:
    """``logits [B, V]`` -> (tokens [B] int64, logprobs [B] fp32), all on the device. Logits in a
    16-bit dtype (the Triton decode step's) are upcast first, exactly, as `_logits` does.

    ``any_stochastic`` False (every row greedy, known on the host) skips the noise;
    ``filter_rows`` (int64 row indices, or None) are the rows with a top-k/top-p/min-p filter;
    ``filter_all``: every row goes through the filters instead (a row whose filters are off comes
    out unchanged, so its token is the same): fixed shapes and no host-made index, so a decode step
    with filtered rows can be captured in a CUDA graph too;
    ``fused``: Triton kernels, one pass over the logits (`kernels.sample_rows_fused`: the same noise;
    Gumbel-max over ``logits / T`` instead of over its log-softmax -- the same argmax up to
    rounding); with filters, each row's keep-set is first found as a value threshold without a
    sort (`filter_kernels.filter_thresholds`: the same keep-sets but where rounding puts an id on the
    boundary), every row through the filters as with ``filter_all``;
    ``filter_kinds``: (top-k, top-p, min-p) -- which filters any row has (host knowledge; the fused
    path compiles the others out)."""
    B, V = logits.shape
    some_filtered = filter_rows is not None and bool(filter_rows.numel())
    filtering = filter_all or some_filtered
    if fused and (not filtering or fused_filters_ok(logits.device)):
        from . import filter_kernels, kernels
        threshold = None
        if filtering:
            threshold = filter_kernels.filter_thresholds(logits, rp.temperature, rp.top_k, rp.top_p, rp.min_p,
                                                         filter_kinds)
        return kernels.sample_rows_fused(logits, rp.temperature, rp.greedy, rp.seeds, rp.steps,
                                         noise=any_stochastic, threshold=threshold)
    logits = logits.float()   # a no-op for fp32 logits
    if not any_stochastic:   # every row greedy (temperature 1): one reduction, no [B, V] log-softmax
        tokens = logits.argmax(dim=-1)
        return tokens, logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    logp = torch.log_softmax(logits / rp.temperature[:, None], dim=-1)
    rows = logp
    if filter_all:
        rows = filtered_logp(logp, rp.top_k, rp.top_p, rp.min_p)
    elif some_filtered:
        rows = logp.clone()
        rows[filter_rows] = filtered_logp(logp[filter_rows], rp.top_k[filter_rows], rp.top_p[filter_rows],
                                          rp.min_p[filter_rows])
    drawn = (rows + seeded_gumbel(rp.seeds, rp.steps, V)).argmax(dim=-1)
    tokens = torch.where(rp.greedy, logits.argmax(dim=-1), drawn)
    lps = logp.gather(1, tokens[:, None])[:, 0]
    return tokens, lps
