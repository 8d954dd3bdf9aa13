"""The off-policy source's ledger of prompt groups: drawn, in flight, finished, taken or discarded.

A *group* is one prompt and its n samples (GRPO's unit: group baselines and dynamic sampling need
all of them). The producer draws groups in a fixed order (``serial``); the trainer takes the
finished ones. This module is the bookkeeping both sides share, under one lock, with no HTTP and
no threads of its own (``megarl/rollout/source.py`` drives it; tests drive it directly):

* **admission** (bounded staleness by construction): a group may start only while
  ``pending < (version + max_staleness + 1 - taken_batches) * groups_per_batch``, ``pending`` being
  the groups drawn and neither taken nor discarded, ``version`` the weights the servers hold. A
  group started at version ``v`` is then taken by step ``v + max_staleness`` at the latest when
  every step takes a full batch (AReaL's rule, counted in batches);
* **taking** a batch at step ``k``: groups whose oldest token is more than ``max_staleness``
  versions behind ``k`` are dropped (``stale: drop``; counted) or kept for the trainer to
  down-weight (``stale: downweight``); then the ``groups_per_batch`` finished groups drawn first;
* **state**: everything pending, finished groups with their tokens, in-flight ones as their
  prompts, plus the loader position, as one JSON-able snapshot taken under the lock (exact resume:
  a resumed run re-issues the in-flight prompts first, then continues the loader).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class Group:
    serial: int                       # draw order
    record_index: int                 # the prompt record's index (what the ledger names)
    start_version: int                # server weights when it was drawn
    samples: Optional[list] = None    # finished: its samples (with rewards and per-token versions)

    def oldest_version(self) -> int:
        """The oldest token's version (the start version for a sample without tokens)."""
        found = [min(s.versions) for s in self.samples or [] if s.versions]
        return min(found) if found else self.start_version


@dataclass
class TakeResult:
    groups: list[Group]
    stale_dropped: list[Group]
    discarded: list[int]              # record indices discarded since the last take (filter, prompt length)
    filtered: int                     # of which by dynamic sampling


class SourceClosed(RuntimeError):
    """The source was closed while the trainer waited for a batch."""


@dataclass
class GroupBuffer:
    groups_per_batch: int
    max_staleness: int
    stale: str = "drop"               # drop | downweight
    version: int = 0                  # weights the servers hold
    taken_batches: int = 0
    next_serial: int = 0
    inflight: dict[int, Group] = field(default_factory=dict)
    ready: dict[int, Group] = field(default_factory=dict)
    discarded: list[int] = field(default_factory=list)       # since the last take
    filtered: int = 0                                          # since the last take
    updating: bool = False
    closed: bool = False
    error: Optional[BaseException] = None

    def __post_init__(self) -> None:
        if self.stale not in ("drop", "downweight"):
            raise ValueError(f"stale must be drop or downweight, got {self.stale!r}")
        self.cond = threading.Condition()

    # ------------------------------------------------------------------ producer side (under cond)
    @property
    def pending(self) -> int:
        return len(self.inflight) + len(self.ready)

    def budget(self) -> int:
        """Groups that may be pending now (see the module docstring)."""
        return (self.version + self.max_staleness + 1 - self.taken_batches) * self.groups_per_batch

    def can_start(self) -> bool:
        return not (self.updating or self.closed or self.error) and self.pending < self.budget()

    def start(self, record_index: int, serial: Optional[int] = None) -> Group:
        """Register a drawn group (``serial`` given: a re-issued one from a checkpoint)."""
        if serial is None:
            serial = self.next_serial
            self.next_serial += 1
        group = Group(serial, record_index, self.version)
        self.inflight[serial] = group
        return group

    def finish(self, group: Group, samples: Optional[list], filtered: bool = False) -> None:
        """A group's rollout ended: ready for the trainer, or (``samples`` None) discarded."""
        self.inflight.pop(group.serial, None)
        if samples is None:
            self.discarded.append(group.record_index)
            self.filtered += int(filtered)
        else:
            group.samples = samples
            self.ready[group.serial] = group
        self.cond.notify_all()

    def discard_unstarted(self, record_index: int) -> None:
        """A drawn prompt that never started (too long): counted like a discarded group."""
        self.discarded.append(record_index)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.cond.notify_all()

    # ------------------------------------------------------------------ trainer side
    def take(self, step: int, give_up_after: Optional[int] = None, timeout_s: Optional[float] = None) -> TakeResult:
        """Block until a batch for step ``step`` is ready and take it. ``give_up_after``: with
        dynamic sampling, after this many discarded groups take whatever is ready (at least one)."""
        with self.cond:
            dropped: list[Group] = []
            while True:
                if self.error is not None:
                    raise self.error
                if self.closed:
                    raise SourceClosed("the rollout source was closed")
                if self.stale == "drop":
                    for serial in [s for s, g in self.ready.items() if step - g.oldest_version() > self.max_staleness]:
                        dropped.append(self.ready.pop(serial))
                enough = len(self.ready) >= self.groups_per_batch
                gave_up = give_up_after is not None and len(self.discarded) + len(dropped) >= give_up_after
                if enough or (gave_up and self.ready):
                    break
                if gave_up and not self.inflight:
                    raise RuntimeError(f"step {step}: dynamic sampling kept no group among {len(self.discarded)} "
                                       f"(all rewards equal)")
                if not self.cond.wait(timeout_s):
                    raise TimeoutError(f"step {step}: no batch after {timeout_s}s "
                                       f"({len(self.ready)} ready, {len(self.inflight)} in flight)")
            chosen = [self.ready.pop(s) for s in sorted(self.ready)[: self.groups_per_batch]]
            result = TakeResult(chosen, dropped, self.discarded + [g.record_index for g in dropped], self.filtered)
            self.discarded, self.filtered = [], 0
            self.taken_batches += 1
            self.cond.notify_all()
            return result

    def wait_drained(self, timeout_s: Optional[float] = None) -> None:
        """Block until no group is in flight (one-step-off: a push waits for the generation)."""
        with self.cond:
            if not self.cond.wait_for(lambda: not self.inflight or self.error is not None or self.closed, timeout_s):
                raise TimeoutError(f"{len(self.inflight)} group(s) still generating after {timeout_s}s")
            if self.error is not None:
                raise self.error

    # ------------------------------------------------------------------ state
    def state_dict(self, encode_sample: Callable[[Any], dict]) -> dict[str, Any]:
        """Call under ``cond`` (with the loader's state read in the same critical section)."""
        groups = sorted(list(self.inflight.values()) + list(self.ready.values()), key=lambda g: g.serial)
        return {"version": self.version, "taken_batches": self.taken_batches, "next_serial": self.next_serial,
                "discarded": list(self.discarded), "filtered": self.filtered,
                "groups": [{"serial": g.serial, "record_index": g.record_index, "start_version": g.start_version,
                            "samples": None if g.samples is None else [encode_sample(s) for s in g.samples]}
                           for g in groups]}

    def load_state_dict(self, state: dict[str, Any], decode_sample: Callable[[dict, int], Any]) -> list[Group]:
        """Restore finished groups into ``ready``; returns the in-flight ones, to be re-issued."""
        with self.cond:
            self.version, self.taken_batches = int(state["version"]), int(state["taken_batches"])
            self.next_serial = int(state["next_serial"])
            self.discarded, self.filtered = list(state["discarded"]), int(state["filtered"])
            reissue = []
            for g in state["groups"]:
                group = Group(int(g["serial"]), int(g["record_index"]), int(g["start_version"]))
                if g["samples"] is None:
                    reissue.append(group)
                else:
                    group.samples = [decode_sample(s, group.record_index) for s in g["samples"]]
                    self.ready[group.serial] = group
            return reissue
