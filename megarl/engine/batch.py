"""The engine's running batch as arrays indexed by KV-cache row.

Why arrays: the scheduler used to walk every running request in Python each step (append the
token, check stops, build the next inputs), a per-step cost proportional to the batch. Here a step
is a fixed number of numpy/torch calls over rows ``[0, size)``; Python touches a request only when
it is admitted or finishes. Sampling parameters live on the device (``RowParams`` views), so the
sampler needs no per-step host->device transfer.

Rows ``[0, size)`` are live; when requests finish, the last live rows move into the gaps
(`compact`), and the caller moves their KV rows the same way, so the model always decodes rows
``[0, size)``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .request import Request
from .sampler import RowParams


class RunningBatch:
    def __init__(self, capacity: int, max_len: int, eos_token_ids: Sequence[int], device: torch.device):
        self.cap, self.max_len, self.device = capacity, max_len, device
        self.eos = tuple(int(t) for t in eos_token_ids)
        self.reqs: List[Optional[Request]] = [None] * capacity
        self.size = 0
        z = lambda dt: np.zeros(capacity, dtype=dt)  # noqa: E731
        self.plen, self.n, self.pending = z(np.int64), z(np.int64), z(np.int64)
        self.max_new, self.min_new = z(np.int64), z(np.int64)
        self.greedy = z(bool)
        self.filtered = np.zeros((capacity, 3), dtype=bool)   # (top-k, top-p, min-p) on, per sampled row
        self.stop = np.full((capacity, 1), -1, dtype=np.int64)      # stop tokens per row (-1 padded)
        self.out_tok = np.zeros((capacity, 1), dtype=np.int64)      # generated tokens per row
        self.out_lp = np.zeros((capacity, 1), dtype=np.float32)
        d = dict(device=device)
        self.d = {"temperature": torch.ones(capacity, dtype=torch.float32, **d),
                  "greedy": torch.zeros(capacity, dtype=torch.bool, **d),
                  "seeds": torch.zeros(capacity, dtype=torch.int64, **d),
                  "steps": torch.zeros(capacity, dtype=torch.int64, **d),
                  "top_k": torch.zeros(capacity, dtype=torch.int64, **d),
                  "top_p": torch.ones(capacity, dtype=torch.float32, **d),
                  "min_p": torch.zeros(capacity, dtype=torch.float32, **d)}

    # ---------------------------------------------------------------- admission
    def add(self, reqs: Sequence[Request]) -> Tuple[int, int]:
        """Put ``reqs`` in rows ``[size, size + len)``; returns that range."""
        a, b = self.size, self.size + len(reqs)
        if b > self.cap:
            raise RuntimeError(f"batch full: {b} > {self.cap}")
        stops = [tuple(r.sampling.stop_token_ids) + (() if r.sampling.ignore_eos else self.eos) for r in reqs]
        width = max(len(s) for s in stops)
        if width > self.stop.shape[1]:
            grown = np.full((self.cap, width), -1, dtype=np.int64)
            grown[:, :self.stop.shape[1]] = self.stop
            self.stop = grown
        need = max(min(r.sampling.max_new_tokens, self.max_len) for r in reqs) + 1
        if need > self.out_tok.shape[1]:
            self.out_tok = np.pad(self.out_tok, ((0, 0), (0, need - self.out_tok.shape[1])))
            self.out_lp = np.pad(self.out_lp, ((0, 0), (0, need - self.out_lp.shape[1])))
        self.stop[a:b] = -1
        for i, (r, s) in enumerate(zip(reqs, stops)):
            self.reqs[a + i] = r
            self.stop[a + i, :len(s)] = s
        sp = [r.sampling for r in reqs]
        self.plen[a:b] = [len(r.input_ids) for r in reqs]
        # a retracted request comes back with the tokens it had (its step count continues too,
        # so a seeded request draws what it would have drawn without the pause)
        done = [len(r.output_ids) if r.retracted else 0 for r in reqs]
        self.n[a:b] = done
        for i, (r, k) in enumerate(zip(reqs, done)):
            if k:
                self.out_tok[a + i, :k] = r.output_ids
                self.out_lp[a + i, :k] = r.logprobs
                self.pending[a + i] = r.output_ids[-1]
        self.max_new[a:b] = [s.max_new_tokens for s in sp]
        self.min_new[a:b] = [s.min_new_tokens for s in sp]
        self.greedy[a:b] = [s.greedy for s in sp]
        self.filtered[a:b] = [(s.top_k > 0, s.top_p < 1.0, s.min_p > 0.0) if s.filtered and not s.greedy
                              else (False, False, False) for s in sp]
        host = {"temperature": [1.0 if s.greedy else s.temperature for s in sp],
                "greedy": [s.greedy for s in sp],
                "seeds": [s.sampling_seed if s.sampling_seed is not None else 0 for s in sp],
                "steps": done,
                "top_k": [s.top_k for s in sp], "top_p": [s.top_p for s in sp], "min_p": [s.min_p for s in sp]}
        for k, t in self.d.items():
            t[a:b] = torch.tensor(host[k], dtype=t.dtype)
        self.size = b
        return a, b

    # ---------------------------------------------------------------- sampling inputs
    def params(self, a: int, b: int) -> RowParams:
        return RowParams(**{k: t[a:b] for k, t in self.d.items()})

    def any_stochastic(self, a: int, b: int) -> bool:
        return not bool(self.greedy[a:b].all())

    def filter_kinds(self, a: int, b: int) -> Tuple[bool, bool, bool]:
        """Which of (top-k, top-p, min-p) some row of ``[a, b)`` has (host knowledge: the fused
        sampler compiles the others out)."""
        k, p, m = self.filtered[a:b].any(axis=0)
        return bool(k), bool(p), bool(m)

    def filter_rows(self, a: int, b: int) -> Optional[torch.Tensor]:
        """Offsets (from ``a``) of the rows that need a top-k/top-p/min-p filter, or None."""
        idx = np.flatnonzero(self.filtered[a:b].any(axis=1))
        return torch.from_numpy(idx).to(self.device) if idx.size else None

    def positions(self) -> np.ndarray:
        """Position of each live row's pending token (the next one to enter the cache)."""
        s = self.size
        return self.plen[:s] + self.n[:s] - 1

    # ---------------------------------------------------------------- one step's tokens
    def record(self, a: int, b: int, tokens: np.ndarray, lps: np.ndarray, count_steps: bool = True) -> Dict[int, dict]:
        """Append one token per row of ``[a, b)``; returns {row: finish reason} of the rows done
        (SGLang's reasons: a stop token once ``min_new_tokens`` are out, else the length limit
        ``max_new_tokens``, else the context)."""
        rows = np.arange(a, b)
        n = self.n[a:b]
        self.out_tok[rows, n] = tokens
        self.out_lp[rows, n] = lps
        n += 1
        self.pending[a:b] = tokens
        if count_steps:   # (a sampled decode launch advances them on the device itself)
            self.d["steps"][a:b] += 1
        stop = (self.stop[a:b] == tokens[:, None]).any(axis=1) & (n >= self.min_new[a:b])
        length = n >= self.max_new[a:b]
        context = self.plen[a:b] + n >= self.max_len
        done = np.flatnonzero(stop | length | context)
        out: Dict[int, dict] = {}
        for i in done.tolist():
            if stop[i]:
                out[a + i] = {"type": "stop", "matched": int(tokens[i])}
            elif length[i]:
                out[a + i] = {"type": "length", "length": int(self.max_new[a + i])}
            else:
                out[a + i] = {"type": "length", "length": int(n[i])}
        return out

    def take(self, row: int) -> Request:
        """The request in ``row`` with its tokens and logprobs filled in; the row becomes a gap."""
        r = self.reqs[row]
        n = int(self.n[row])
        r.output_ids = self.out_tok[row, :n].tolist()
        r.logprobs = self.out_lp[row, :n].tolist()
        self.reqs[row] = None
        return r

    # ---------------------------------------------------------------- gaps
    def compact(self, finished: Sequence[int]) -> Tuple[List[int], List[int], int]:
        """Close the gaps ``finished`` rows (already taken) leave: the last live rows move into the
        gaps below the new size. Work is proportional to the finished rows, not the batch.
        Returns (src rows, dst rows, positions to copy) for the KV cache, which the caller moves
        the same way."""
        new = self.size - len(finished)
        gone = set(finished)
        holes = sorted(f for f in gone if f < new)
        movers = [i for i in range(new, self.size) if i not in gone]
        length = 0
        if holes:
            src, dst = np.asarray(movers), np.asarray(holes)
            length = int((self.plen[src] + self.n[src]).max())
            for arr in (self.plen, self.n, self.pending, self.max_new, self.min_new, self.greedy, self.filtered,
                        self.stop, self.out_tok, self.out_lp):
                arr[dst] = arr[src]
            ts, td = torch.from_numpy(src).to(self.device), torch.from_numpy(dst).to(self.device)
            for t in self.d.values():
                t[td] = t[ts]
            for s, d in zip(movers, holes):
                self.reqs[d], self.reqs[s] = self.reqs[s], None
        self.size = new
        return movers, holes, length

    def live(self) -> List[Request]:
        return [r for r in self.reqs[:self.size] if r is not None]

    def clear(self) -> List[Request]:
        """Drop every row; returns the requests that were in them."""
        out = self.live()
        self.reqs = [None] * self.cap
        self.size = 0
        return out
