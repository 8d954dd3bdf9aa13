"""`DecodeGraphs` on CPU, for tests of the engine's graph path without a GPU."""
from __future__ import annotations

from megarl.engine.graphs import DecodeGraphs, PrefillGraphs


class _EmulatedCapture:
    """A "graph" replays the captured body on the static buffers (what a CUDA graph replay does),
    so bucketing, padding, reuse, invalidation and the signature check run as on the GPU; only the
    warm-up stream and the recording are replaced."""

    def _warm_up(self, body, *args):
        body(*args)

    def _record(self, body, *args):
        out = body(*args).clone()

        class Replay:
            def replay(_):
                out.copy_(body(*args))
        return Replay(), out


class EmulatedGraphs(_EmulatedCapture, DecodeGraphs):
    """`DecodeGraphs` with emulated capture (CPU)."""


class EmulatedPrefillGraphs(_EmulatedCapture, PrefillGraphs):
    """`PrefillGraphs` with emulated capture (CPU)."""
