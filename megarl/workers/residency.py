"""Which Megatron role holds which state on the GPU, phase by phase (colocated runs).

Why one place: in a colocated run the actor, critic, reference, reward model and teacher share GPUs
with the rollout servers. Each phase needs little: a forward needs one role's weights, training
one role's weights, gradients and optimizer, the push the actor's weights. Everything else whose
``ROLE.offload.<kind>`` switch is on waits in pinned host memory (``workers/offload.py``). The
trainer names the phase; this class moves the difference, and records the GPU peak of the phase
that just ended.
"""
from __future__ import annotations

from typing import Any, Optional

from megarl.workers.offload import KINDS

NEEDS = {"forward": ("params",), "train": KINDS, "push": ("params",)}
GIB = 1024 ** 3


def offload_switches(cfg: Any, roles: list[str]) -> dict[str, tuple[str, ...]]:
    """role -> the kinds it offloads (switches resolved: null counts as off here; `megarl train`
    resolves null from the memory plan before the run starts)."""
    out = {}
    for role in roles:
        o = getattr(cfg, role).offload
        out[role] = tuple(k for k in KINDS if getattr(o, k))
    return out


class Residency:
    def __init__(self, groups: dict[str, Any], switches: dict[str, tuple[str, ...]], cuda: bool):
        # a role served by another role's ranks (LoRA: the reference is the actor with adapters off)
        self.alias = {name: g.actor.role for name, g in groups.items() if hasattr(g, "actor")}
        self.groups = {name: g for name, g in groups.items() if name not in self.alias}
        self.switches = {r: k for r, k in switches.items() if k and r in self.groups}
        self.cuda = cuda
        self.phase: Optional[str] = None
        self.resident = {r: set(KINDS) for r in self.switches}
        self._moves: dict[str, float] = {}
        self._peaks: dict[str, float] = {}

    @property
    def active(self) -> bool:
        return bool(self.switches)

    def hold(self, phase: str, role: Optional[str] = None, need: str = "forward") -> None:
        """Enter ``phase``: ``role`` keeps what ``need`` (forward | train | push) requires, every
        other switched state leaves the GPU (offloads first, so the memory is free for the onload)."""
        self._record_peaks()
        self.phase = phase
        role = self.alias.get(role, role)
        wanted = {r: (set(NEEDS[need]) if r == role else set()) for r in self.switches}
        for r, kinds in self.switches.items():
            out = [k for k in kinds if k in self.resident[r] and k not in wanted[r]]
            if out:
                self._add(self.groups[r].call("offload", out))
                self.resident[r].difference_update(out)
        if role in self.switches:
            back = [k for k in self.switches[role] if k in wanted[role] and k not in self.resident[role]]
            if back:
                self._add(self.groups[role].call("onload", back))
                self.resident[role].update(back)
        self._start_phase()

    def release_all(self, phase: str) -> None:
        """Every switched state to host (rollout, or after the push)."""
        self.hold(phase, None)

    def metrics(self) -> dict[str, float]:
        """Bytes and seconds moved since the last call (summed over roles, slowest rank), and per
        phase and role (largest rank) the GPU memory held during the phase and its peak."""
        self._record_peaks()
        out = dict(self._moves)
        for direction in ("offload", "onload"):
            s, b = out.get(f"memory/{direction}_s", 0.0), out.get(f"memory/{direction}_bytes", 0.0)
            if s > 0 and b:
                out[f"memory/{direction}_GBps"] = b / s / 1e9
        out.update(self._peaks)
        self._moves, self._peaks = {}, {}
        return out

    def _add(self, per_rank: list[dict[str, float]]) -> None:
        for key in ("offload", "onload"):
            seconds = [m.get(f"memory/{key}_s", 0.0) for m in per_rank]
            if any(f"memory/{key}_s" in m for m in per_rank):
                self._moves[f"memory/{key}_s"] = self._moves.get(f"memory/{key}_s", 0.0) + max(seconds)
                self._moves[f"memory/{key}_bytes"] = (self._moves.get(f"memory/{key}_bytes", 0.0)
                                                      + sum(m.get(f"memory/{key}_bytes", 0.0) for m in per_rank))

    def _start_phase(self) -> None:
        """After the moves: what each role holds during the phase, and a fresh peak counter (the
        peak of a phase is its own work's, not the moves into it)."""
        if not self.cuda:
            return
        for role, group in self.groups.items():
            held = max(s.get("allocated", 0.0) for s in group.call("memory_stats"))
            key = f"memory/resident_gib/{self.phase}/{role}"
            self._peaks[key] = max(self._peaks.get(key, 0.0), held / GIB)

    def _record_peaks(self) -> None:
        if not self.cuda or self.phase is None:
            return
        for role, group in self.groups.items():
            stats = group.call("memory_stats")
            peak = max(s.get("peak", 0.0) for s in stats)
            key = f"memory/peak_gib/{self.phase}/{role}"
            self._peaks[key] = max(self._peaks.get(key, 0.0), peak / GIB)
