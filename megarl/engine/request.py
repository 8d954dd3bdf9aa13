"""One generation request of the embedded engine: its sampling parameters, its future, its result
(SGLang's `/generate` response item)."""
from __future__ import annotations

import concurrent.futures
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from megarl.wire.protocol import INPUT_TOKEN_LOGPROBS
from megarl.wire.versions import weight_version_spans

_SEED_MASK = 0x7FFFFFFF


@dataclass
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    sampling_seed: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "Sampling":
        d = dict(d or {})
        s = cls()
        for k in ("max_new_tokens", "min_new_tokens", "top_k", "sampling_seed"):
            if d.get(k) is not None:
                setattr(s, k, int(d[k]))
        for k in ("temperature", "top_p", "min_p"):
            if d.get(k) is not None:
                setattr(s, k, float(d[k]))
        if d.get("ignore_eos") is not None:
            s.ignore_eos = bool(d["ignore_eos"])
        if d.get("stop_token_ids"):
            s.stop_token_ids = tuple(int(t) for t in d["stop_token_ids"])
        if s.max_new_tokens < 0 or s.temperature < 0 or not (0 < s.top_p <= 1) or s.top_k == 0:
            raise ValueError(f"invalid sampling params {d}")
        return s

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def filtered(self) -> bool:
        """A top-k / top-p / min-p filter applies (to a non-greedy row)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def for_sample(self, j: int) -> "Sampling":
        """Parameters of sample ``j`` of a request with ``n`` samples: a copy, whose seed (when
        one is given) is derived from (seed, j) -- sample 0 keeps the seed itself -- so the n
        samples differ and each is reproducible. (SGLang copies one seed to all n samples, which
        under its deterministic mode makes them identical: megarl's manager therefore sends
        seeded samples as separate items, never as ``n``.)"""
        if j == 0 or self.sampling_seed is None:
            return replace(self)
        return replace(self, sampling_seed=derive_seed(self.sampling_seed, j))


def derive_seed(seed: int, j: int) -> int:
    """A 31-bit seed for sample ``j`` of a request seeded with ``seed`` (splitmix-style mix)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + (j + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 29)) & _SEED_MASK


@dataclass
class Request:
    input_ids: List[int]
    sampling: Sampling
    return_logprob: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    output_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    t_start: float = field(default_factory=time.time)
    cached_tokens: int = 0     # prompt tokens whose KV was copied, not computed (SGLang's meta field)
    kv_epoch: int = -1         # engine weight epoch its prompt KV was computed under
    # (old weight version, output tokens so far) at each weight change while this request lived
    version_events: List[Tuple[str, int]] = field(default_factory=list)
    retracted: bool = False    # back in the queue with its KV freed: re-prefilled with its output
    return_routed_experts: bool = False   # SGLang's request field (R3); needs a recording model
    routed_experts_start_len: int = 0
    routed_experts: Optional[str] = None  # meta_info["routed_experts"]: base64 of int32 [rows, layers, k]
    lora: Optional[str] = None            # SGLang's lora_path: the name of a loaded LoRA adapter (None: base)
    logprob_start_len: int = -1           # SGLang's field: input logprobs from this position (-1: none)
    input_logprobs: Optional[List[list]] = None   # meta_info["input_token_logprobs"] (input_logprobs.py)
    _key: Optional[Tuple[Any, ...]] = field(default=None, repr=False)

    @property
    def key(self) -> Tuple[Any, ...]:
        """The prompt and its adapter as a hashable key (prefix sharing between requests with the same
        prompt under the same adapter: KV computed through one adapter is never another's)."""
        if self._key is None:
            self._key = (self.lora, *self.input_ids)
        return self._key

    def result(self, weight_version: str) -> dict:
        spans = weight_version_spans(self.version_events, weight_version, len(self.output_ids))
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,     # SGLang 0.5.23: which version produced which tokens
            "e2e_latency": time.time() - self.t_start,
        }
        if self.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.output_ids)]
        if self.input_logprobs is not None:
            meta[INPUT_TOKEN_LOGPROBS] = self.input_logprobs
        if self.routed_experts is not None:
            meta["routed_experts"] = self.routed_experts
        return {"output_ids": list(self.output_ids), "meta_info": meta}
