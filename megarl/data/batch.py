"""A batch of trajectories as flat tensors: the one layout from the driver to every worker.

Why flat: a step of a large run holds millions of response tokens; per-sample Python lists (and
``[B, R]`` tensors padded to the longest response) cost driver time and bytes proportional to the
padding. Here every sequence (``prompt + response``) is laid end to end in ``tokens``, with
``seq_offsets`` marking where each starts; per-response-token quantities (logprobs, advantages,
values, ...) are laid end to end in the same sample order, in ``token_fields``; per-sample ones
(rewards, ...) are ``sample_fields``; per-token ones over the whole sequence, aligned with ``tokens``
(an MoE rollout's routed experts), are ``seq_fields``. Selecting samples, splitting into data-parallel shards and
reassembling results are index arithmetic over these tensors (:func:`segment_index`), never loops
over samples. Algorithms that want ``[B, R]`` get it from :meth:`TokenBatch.padded` and give it back
through :meth:`TokenBatch.unpad`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor


ROUTES_KEY = "routed_experts"  # sequence field: MoE experts the rollout chose per token and layer (R3)
LOSS_MASK = "loss_mask"   # token field: 1 for the model's tokens, 0 for environment tokens (agent loop)


def lengths_to_offsets(lengths: Tensor) -> Tensor:
    """``[n]`` lengths -> ``[n + 1]`` int64 offsets (0, cumulative sums)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def ranges(starts: Tensor, lens: Tensor) -> Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lens)])`` without a Python loop."""
    starts, lens = starts.to(torch.int64), lens.to(torch.int64)
    total = int(lens.sum()) if lens.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    out_starts = torch.zeros_like(lens)
    torch.cumsum(lens[:-1], 0, out=out_starts[1:])
    return torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(starts - out_starts, lens,
                                                                            output_size=total)


def segment_index(offsets: Tensor, index: Tensor | Sequence[int]) -> Tensor:
    """Flat positions of segments ``index`` (in that order) of a tensor split at ``offsets``:
    ``cat([arange(offsets[i], offsets[i + 1]) for i in index])``."""
    index = torch.as_tensor(index, dtype=torch.int64)
    return ranges(offsets[index], offsets[index + 1] - offsets[index])


@dataclass
class TokenBatch:
    """Samples as flat tensors (see the module docstring). All offsets/lengths are int64 on CPU."""

    tokens: Tensor                                            # [N] token ids, sequences end to end
    seq_offsets: Tensor                                       # [B + 1]
    prompt_lens: Tensor                                       # [B]
    token_fields: dict[str, Tensor] = field(default_factory=dict)   # each [sum(response lens)]
    sample_fields: dict[str, Tensor] = field(default_factory=dict)  # each [B]
    seq_fields: dict[str, Tensor] = field(default_factory=dict)     # each [N, ...], aligned with tokens

    def __post_init__(self) -> None:
        self.seq_offsets = self.seq_offsets.to(torch.int64)
        self.prompt_lens = self.prompt_lens.to(torch.int64)
        if self.seq_offsets.numel() != self.prompt_lens.numel() + 1:
            raise ValueError(f"seq_offsets has {self.seq_offsets.numel()} entries for {self.prompt_lens.numel()} samples")
        if int(self.seq_offsets[-1]) != self.tokens.numel():
            raise ValueError(f"seq_offsets end at {int(self.seq_offsets[-1])}, tokens has {self.tokens.numel()}")
        bad = (self.prompt_lens < 1) | (self.prompt_lens > self.seq_lens)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"sample {i}: prompt length {int(self.prompt_lens[i])} outside a sequence of "
                             f"{int(self.seq_lens[i])} tokens")
        n_resp = int(self.response_lens.sum())
        for name, t in self.token_fields.items():
            if t.shape[0] != n_resp:
                raise ValueError(f"token field {name!r} has {t.shape[0]} entries, the batch {n_resp} response tokens")
        for name, t in self.sample_fields.items():
            if t.shape[0] != len(self):
                raise ValueError(f"sample field {name!r} has {t.shape[0]} entries, the batch {len(self)} samples")
        for name, t in self.seq_fields.items():
            if t.shape[0] != self.tokens.numel():
                raise ValueError(f"sequence field {name!r} has {t.shape[0]} entries, the batch {self.tokens.numel()} tokens")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       token_fields: Optional[dict[str, Sequence[Sequence[float]]]] = None,
                       sample_fields: Optional[dict[str, Any]] = None) -> "TokenBatch":
        """From per-sample token lists (what a rollout returns); one flattening pass, no padding."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        plens = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        rlens = np.fromiter((len(r) for r in responses), dtype=np.int64, count=len(responses))
        flat: list[int] = []
        for p, r in zip(prompts, responses):
            flat.extend(p)
            flat.extend(r)
        tokens = torch.from_numpy(np.asarray(flat, dtype=np.int64))
        fields = {}
        for name, rows in (token_fields or {}).items():
            vals = np.zeros(int(rlens.sum()), dtype=np.float32)
            pos = 0
            for row, n in zip(rows, rlens):
                k = min(len(row), int(n))
                vals[pos:pos + k] = row[:k]
                pos += int(n)
            fields[name] = torch.from_numpy(vals)
        return cls(tokens, lengths_to_offsets(torch.from_numpy(plens + rlens)), torch.from_numpy(plens), fields,
                   {k: torch.as_tensor(v) for k, v in (sample_fields or {}).items()})

    # ------------------------------------------------------------------ shape
    def __len__(self) -> int:
        return self.prompt_lens.numel()

    @property
    def seq_lens(self) -> Tensor:
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    @property
    def response_lens(self) -> Tensor:
        return self.seq_lens - self.prompt_lens

    @property
    def response_offsets(self) -> Tensor:
        return lengths_to_offsets(self.response_lens)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def sequence(self, i: int) -> Tensor:
        return self.tokens[int(self.seq_offsets[i]):int(self.seq_offsets[i + 1])]

    def response_token_index(self) -> Tensor:
        """Position in ``tokens`` of every response token, in sample order (``[sum R]``)."""
        return ranges(self.seq_offsets[:-1] + self.prompt_lens, self.response_lens)

    # ------------------------------------------------------------------ selection
    def select(self, index: Tensor | Sequence[int]) -> "TokenBatch":
        """The samples ``index`` in that order (fields included). An ascending run of consecutive
        samples is a view (no copy); otherwise each sample is one slice copied once."""
        idx = [int(i) for i in (index.tolist() if isinstance(index, Tensor) else index)]
        n = len(idx)
        if n and idx == list(range(idx[0], idx[0] + n)):
            return self.slice(idx[0], idx[0] + n)
        it = torch.tensor(idx, dtype=torch.int64)
        return TokenBatch(_gather_segments(self.tokens, self.seq_offsets, idx),
                          lengths_to_offsets(self.seq_lens[it]), self.prompt_lens[it],
                          {k: _gather_segments(v, self.response_offsets, idx) for k, v in self.token_fields.items()},
                          {k: v[it] for k, v in self.sample_fields.items()},
                          {k: _gather_segments(v, self.seq_offsets, idx) for k, v in self.seq_fields.items()})

    def slice(self, start: int, stop: int) -> "TokenBatch":
        """Samples ``start .. stop - 1`` as views of this batch's tensors."""
        so, ro = self.seq_offsets, self.response_offsets
        a, b = int(so[start]), int(so[stop])
        ra, rb = int(ro[start]), int(ro[stop])
        return TokenBatch(self.tokens[a:b], so[start:stop + 1] - a, self.prompt_lens[start:stop],
                          {k: v[ra:rb] for k, v in self.token_fields.items()},
                          {k: v[start:stop] for k, v in self.sample_fields.items()},
                          {k: v[a:b] for k, v in self.seq_fields.items()})

    def with_fields(self, names: Iterable[str]) -> "TokenBatch":
        """The same samples with only the named token/sample fields (what one worker call needs)."""
        names = set(names)
        return TokenBatch(self.tokens, self.seq_offsets, self.prompt_lens,
                          {k: v for k, v in self.token_fields.items() if k in names},
                          {k: v for k, v in self.sample_fields.items() if k in names},
                          {k: v for k, v in self.seq_fields.items() if k in names})

    # ------------------------------------------------------------------ padded views for algorithms
    def response_mask(self) -> Tensor:
        """``[B, R_max]`` float mask of response tokens."""
        lens = self.response_lens
        width = int(lens.max()) if len(self) else 0
        return (torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)).float()

    def loss_mask(self) -> Tensor:
        """``[B, R_max]`` float mask of the response tokens the loss and advantages cover: the
        response mask, times the ``loss_mask`` token field when there is one (agent trajectories:
        environment tokens are 0 there)."""
        mask = self.response_mask()
        if LOSS_MASK in self.token_fields:
            mask = mask * self.padded(self.token_fields[LOSS_MASK].to(mask.dtype))
        return mask

    def padded(self, flat: Tensor, fill: float = 0.0) -> Tensor:
        """A per-response-token flat tensor as ``[B, R_max]`` (right-padded with ``fill``)."""
        mask = self.response_mask().bool()
        out = torch.full(mask.shape, fill, dtype=flat.dtype)
        out[mask] = flat
        return out

    def unpad(self, padded: Tensor) -> Tensor:
        """``[B, R_max]`` -> the flat per-response-token tensor (inverse of :meth:`padded`)."""
        mask = self.response_mask().bool()
        return padded[:, : mask.shape[1]][mask]

    # ------------------------------------------------------------------ transport
    def to_payload(self) -> dict[str, Any]:
        """Plain dict of numpy arrays: Ray stores numpy buffers out of band and workers on the same node
        read them from shared memory without a copy (torch tensors would be pickled whole)."""
        return {"tokens": self.tokens.numpy(), "seq_offsets": self.seq_offsets.numpy(),
                "prompt_lens": self.prompt_lens.numpy(),
                "token_fields": {k: v.numpy() for k, v in self.token_fields.items()},
                "sample_fields": {k: v.numpy() for k, v in self.sample_fields.items()},
                "seq_fields": {k: v.numpy() for k, v in self.seq_fields.items()}}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> "TokenBatch":
        def t(a: np.ndarray) -> Tensor:
            with warnings.catch_warnings():  # read-only shared-memory buffers: we never write them
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.as_tensor(a)
        return cls(t(payload["tokens"]), t(payload["seq_offsets"]), t(payload["prompt_lens"]),
                   {k: t(v) for k, v in payload["token_fields"].items()},
                   {k: t(v) for k, v in payload["sample_fields"].items()},
                   {k: t(v) for k, v in payload.get("seq_fields", {}).items()})



def _gather_segments(values: Tensor, offsets: Tensor, index: list[int]) -> Tensor:
    """``cat([values[offsets[i]:offsets[i + 1]] for i in index])``: one slice per segment, one copy
    (a flat index of every element costs 8 bytes per element and a repeat_interleave pass)."""
    if not index:
        return values[:0].clone()
    offs = offsets.tolist()
    arr = values.numpy()
    out = np.concatenate([arr[offs[i]:offs[i + 1]] for i in index])
    return torch.from_numpy(out)
