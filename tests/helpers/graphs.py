"""`DecodeGraphs` on CPU, for tests of the engine's graph path without a GPU."""
from __future__ import annotations

from megarl.engine.graphs import DecodeGraphs


class EmulatedGraphs(DecodeGraphs):
    """A "graph" replays the captured body on the static buffers (what a CUDA graph replay does),
    so bucketing, padding, reuse, invalidation and the signature check run as on the GPU; only the
    warm-up stream and the recording are replaced."""

    def _warm_up(self, body, ids, pos, Bb, Lk):
        body(ids, pos, Bb, Lk)

    def _record(self, body, ids, pos, Bb, Lk):
        out = body(ids, pos, Bb, Lk).clone()

        class Replay:
            def replay(_):
                out.copy_(body(ids, pos, Bb, Lk))
        return Replay(), out
