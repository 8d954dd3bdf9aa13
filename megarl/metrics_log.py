"""Per-step metrics: the configured sinks (``metrics_sinks.py``: tensorboard, wandb, mlflow) and a
compact console line with a progress bar."""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Mapping, Optional, Sequence

CONSOLE_KEYS = [("reward/mean", "reward", "{:.3f}"), ("response/length_mean", "len", "{:.0f}"),
                ("actor/pg_loss", "pg", "{:+.4f}"), ("actor/clip_frac", "clip", "{:.3f}"),
                ("actor/entropy", "ent", "{:.3f}"), ("actor/kl_loss", "kl", "{:.4f}"),
                ("actor/grad_norm", "gn", "{:.3f}"), ("rollout/logprob_diff_mean", "lpdiff", "{:.1e}"),
                ("time/rollout_s", "roll_s", "{:.1f}"), ("time/old_logprobs_s", "lp_s", "{:.1f}"),
                ("time/train_s", "train_s", "{:.1f}"), ("time/sync_s", "sync_s", "{:.1f}"),
                ("time/step_s", "step_s", "{:.1f}")]


class MetricsLogger:
    def __init__(self, tensorboard_dir: Optional[Path], total_steps: int, progress_bar: bool = True,
                 sinks: Optional[Sequence] = None):
        """``sinks`` (``metrics_sinks.build_sinks``) receive every step; without them, TensorBoard
        event files in ``tensorboard_dir``."""
        from megarl.metrics_sinks import TensorBoardSink

        self.sinks = list(sinks) if sinks is not None else [TensorBoardSink(tensorboard_dir)]
        self.total = total_steps
        self.progress_bar = progress_bar
        self.start = time.time()

    def log(self, step: int, metrics: Mapping[str, float], console: bool = True) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)
        if console:
            print(self.format_line(step, metrics), flush=True)

    def format_line(self, step: int, metrics: Mapping[str, float]) -> str:
        parts = [f"{short}={fmt.format(metrics[key])}" for key, short, fmt in CONSOLE_KEYS if key in metrics]
        done = step / max(self.total, 1)
        bar = ""
        if self.progress_bar:
            filled = int(20 * done)
            elapsed = time.time() - self.start
            eta = elapsed / max(done, 1e-9) - elapsed if done > 0 else 0.0
            bar = f"[{'#' * filled}{'.' * (20 - filled)}] eta {eta / 60:.1f}m "
        return f"step {step}/{self.total} {bar}" + " ".join(parts)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def note(message: str) -> None:
    print(f"[megarl] {message}", file=sys.stderr, flush=True)


class PhaseTimer:
    """Wall seconds of each phase of a step, measured by one context manager (``with
    timer("train"): ...``), reported as ``time/<phase>_s``; ``time/step_s`` is the wall of the
    whole step (from this timer's creation to :meth:`metrics`), so work between the phases --
    batch building, advantages, the servers handing memory over -- is counted too and shows as
    ``time/other_s``; for the token-bound phases also ``throughput/<phase>_tokens_per_s``."""

    def __init__(self, around: Optional[Callable[[str], ContextManager[None]]] = None) -> None:
        self.seconds: dict[str, float] = {}
        self.around = around   # e.g. a profiler of this step's phases (megarl.profiling)
        self.started = time.time()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.time()
        try:
            with self.around(phase) if self.around else contextlib.nullcontext():
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.time() - start

    def metrics(self, tokens: float, throughput_phases: Sequence[str] = ("rollout", "old_logprobs", "train")
                ) -> dict[str, float]:
        out = {f"time/{phase}_s": s for phase, s in self.seconds.items()}
        wall = time.time() - self.started
        out["time/other_s"] = max(wall - sum(self.seconds.values()), 0.0)
        out["time/step_s"] = wall
        for phase in throughput_phases:
            if phase in self.seconds:
                out[f"throughput/{phase}_tokens_per_s"] = tokens / max(self.seconds[phase], 1e-9)
        return out
