"""The rollout manager as it was before batched requests: one ``/generate`` per sample.

Kept only as a baseline: ``benchmarks/bench_e2e.py --rollout-only`` times it against the batched
manager, and a test checks that batching changed no sample.
"""
from __future__ import annotations

from typing import Any, Optional

from megarl.rollout.manager import GenerateOutput, RolloutManager, _Chunk, sample_seed


class PerSampleManager(RolloutManager):
    async def _generate_all(self, prompts, n, sampling, seed, emit, routes):
        chunks = [(_Chunk(p, 1, 1), k) for p in range(len(prompts)) for k in range(n)]
        partial: dict[int, list[Optional[GenerateOutput]]] = {}

        async def one_sample(i: int, c: _Chunk, k: int) -> Any:
            params = dict(sampling, n=1)
            if seed is not None:
                params["sampling_seed"] = sample_seed(seed, c.first * n + k)
            outs = await self._send(i, c, prompts[c.first], params, f"prompt {c.first} sample {k}", routes)
            slot = partial.setdefault(c.first, [None] * n)
            slot[k] = outs[0]
            if all(o is not None for o in slot):
                emit((c.first, partial.pop(c.first)))
        await self._gather(one_sample(i, c, k) for i, (c, k) in enumerate(chunks))
