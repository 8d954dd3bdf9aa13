"""Phase deadlines: a hung step names its rank and phase, leaves every rank's stack, and requeues.

Why: a Megatron rank that stops (a stuck NCCL peer, a node gone without closing its sockets, a
SIGSTOP) leaves every other rank in a collective and the driver in ``ray.get``: the run hangs
silently until a collective timeout, if any, and nothing says which rank or which phase. Here each
phase the trainer runs (``with watchdog.phase("train", step)``, or through :class:`PhaseTimer`'s
``around`` hook) gets a deadline (:class:`Deadlines`: ``factor`` x the phase's longest time so far,
``first_step_s`` before it has finished once, never below ``min_s``, or a fixed ``phase_s``). A
thread of the driver watches the running phase; when its deadline passes it

1. asks every rank for its Python stack (``workers/stack_dump.py``: faulthandler on a signal for a
   live rank, py-spy for a stopped one) and writes them, with the driver's own, to
   ``OUTPUT_DIR/watchdog/stacks_stepS_PHASE.txt``;
2. prints one line naming the phase and the rank that cannot go on (stopped, dead) -- role, rank,
   host, pid, /proc state -- and the stacks file (``hang.json`` holds the same for tools);
3. writes a checkpoint of the last finished step only where the ranks are idle and healthy (a hang
   in ``rollout``, ``release`` or ``eval``, no rank stopped): a stopped rank blocks its role's
   collectives, which a checkpoint needs, so after a hang in a Megatron pass the run resumes from
   the last checkpoint written before;
4. stops the ranks and servers and exits with :data:`REQUEUE_EXIT`, which ``launch/slurm`` requeues.

The trainer only marks its phases; everything else is here. The driver's main thread stays where the
hang left it (blocked in Ray); :meth:`Watchdog.settle` keeps it from exiting with another code when
the ranks are killed under it.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional

from megarl.config.watchdog import PHASES
from megarl.workers.stack_dump import RankProcess, RankStack, inspect_ranks

REQUEUE_EXIT = 75   # EX_TEMPFAIL: "try again later" -- launch/slurm/common.sh requeues the job on it
IDLE_RANK_PHASES = ("rollout", "release", "eval")   # phases in which no Megatron rank is in a call
CLOSE_S = 30.0   # for the run's own close after a hang (servers, Ray); a part stuck in the hang is left to the exit
__all__ = ["Deadlines", "Watchdog", "REQUEUE_EXIT", "PHASES", "hang_line"]


@dataclasses.dataclass
class Deadlines:
    """The deadline of each phase from this run's own history. ``factor`` x the longest time the
    phase took so far (a phase's time varies with its batch; its worst case so far times a margin
    is what a healthy run can be expected to stay under), ``first_step_s`` before the phase finished
    once (compilation, warm-up and the first checkpoint write make first times unlike the rest),
    never below ``min_s`` (a phase of a second would otherwise get a deadline that a loaded file
    system or a garbage collection passes); ``fixed`` deadlines win over history."""

    factor: float
    first_step_s: float
    min_s: float
    fixed: dict[str, float] = dataclasses.field(default_factory=dict)
    longest: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_config(cls, w: Any) -> "Deadlines":
        return cls(float(w.factor), float(w.first_step_s), float(w.min_s), {k: float(v) for k, v in w.phase_s.items()})

    def of(self, phase: str) -> float:
        if phase in self.fixed:
            return self.fixed[phase]
        if phase not in self.longest:
            return max(self.min_s, self.first_step_s)
        return max(self.min_s, self.factor * self.longest[phase])

    def record(self, phase: str, seconds: float) -> None:
        """A phase finished in ``seconds`` (only finished phases count: a failed one says nothing
        about how long the phase takes)."""
        self.longest[phase] = max(self.longest.get(phase, 0.0), float(seconds))


@dataclasses.dataclass(frozen=True)
class _Running:
    phase: str
    step: int
    deadline_s: float
    started: float            # time.monotonic()

    @property
    def expires(self) -> float:
        return self.started + self.deadline_s


def hang_line(running: _Running, elapsed: float, found: list[RankStack], stacks: Path) -> str:
    """The one line a hang prints: phase, step, deadline, the rank that cannot go on (or that none is
    stopped), and the stacks file."""
    head = (f"watchdog: step {running.step} phase {running.phase} passed its {running.deadline_s:.0f}s deadline "
            f"(running {elapsed:.0f}s): ")
    culprit = next((s for s in found if s.stopped), None)
    if culprit is not None:
        p = culprit.process
        who = f"{p.role} rank {p.rank} on host {p.host} (pid {p.pid}) is {culprit.state}"
    elif found:
        roles = sorted({s.process.role for s in found})
        hosts = sorted({s.process.host for s in found})
        who = (f"no rank is stopped or gone ({', '.join(roles)}: {len(found)} ranks alive on host "
               f"{', '.join(hosts)}; their stacks show where each waits)")
    else:
        who = f"no Megatron rank in this run; the driver's stack on host {socket.gethostname()} shows where it waits"
    return head + who + f"; stacks of {len(found)} ranks and the driver in {stacks}"


class Watchdog:
    """Deadlines on the trainer's phases, watched by one daemon thread of the driver.

    ``checkpoint(phase)`` writes a checkpoint of the last finished step (called only after a hang in
    a phase that leaves every rank idle, and no rank stopped); ``close()`` stops the run's parts; both
    run on the watchdog's thread, each bounded. ``exit`` ends the process (``os._exit``: the main
    thread is blocked and cannot be joined), after every child process of the driver is ended
    (``end_children``)."""

    def __init__(self, settings: Any, folder: Path, *, checkpoint: Optional[Callable[[str], Any]] = None,
                 close: Optional[Callable[[], None]] = None, exit: Callable[[int], None] = os._exit,
                 dump_wait_s: float = 10.0, end_children: bool = True):
        self.enabled = bool(settings.enabled)
        self.deadlines = Deadlines.from_config(settings)
        self.folder = Path(folder)
        self.checkpoint, self.close, self.exit = checkpoint, close, exit
        self.dump_wait_s = dump_wait_s
        self.end_children = end_children     # False: in-process tests, whose process has other children
        self.ranks: list[RankProcess] = []
        self.actors: list[Any] = []          # Ray actor handles, killed after a hang
        self.expired: Optional[_Running] = None
        self._cond = threading.Condition()
        self._running: Optional[_Running] = None
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ set-up
    def arm(self, groups: dict[str, Any]) -> None:
        """Every rank of ``groups`` registers its stack dump (``arm_watchdog``) and says where it runs."""
        if not self.enabled:
            return
        folder = str(self.folder / "ranks")
        for group in groups.values():
            if not hasattr(group, "call"):     # the LoRA reference: the actor's ranks, armed with the actor
                continue
            self.ranks += group.call("arm_watchdog", folder)
            if getattr(group, "backend", "") == "ray":
                self.actors += list(group.workers)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="megarl-watchdog", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """Run a phase under its deadline; its time counts towards later deadlines when it finishes."""
        if not self.enabled:
            yield
            return
        self._start()
        running = _Running(name, step, self.deadlines.of(name), time.monotonic())
        with self._cond:
            outer, self._running = self._running, running
            self._cond.notify_all()
        finished = False
        try:
            yield
            finished = True
        finally:
            with self._cond:
                if self._running is running:
                    self._running = outer
                self._cond.notify_all()
            if finished:
                self.deadlines.record(name, time.monotonic() - running.started)

    def around(self, step: int, inner: Optional[Callable[[str], ContextManager[None]]] = None
               ) -> Callable[[str], ContextManager[None]]:
        """A ``PhaseTimer(around=...)`` hook: each timed phase of ``step`` under its deadline, with
        ``inner`` (a profiler) inside."""
        @contextlib.contextmanager
        def hook(name: str) -> Iterator[None]:
            with self.phase(name, step), (inner(name) if inner else contextlib.nullcontext()):
                yield
        return hook

    def settle(self) -> None:
        """Called by the main thread on its way out: after a hang the watchdog ends the process with
        its own exit code, so the main thread (woken by the ranks it kills) waits for that."""
        if self.expired is not None and threading.current_thread() is not self._thread:
            threading.Event().wait()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ the watch
    def _watch(self) -> None:
        with self._cond:
            while not self._stopped:
                running = self._running
                if running is None:
                    self._cond.wait()
                    continue
                left = running.expires - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self.expired = running
                break
        if self.expired is not None:
            try:
                self._expire(self.expired)
            finally:   # also when the report itself failed (a full disk): the main thread waits for this
                self.exit(REQUEUE_EXIT)

    def _expire(self, running: _Running) -> None:
        elapsed = time.monotonic() - running.started
        self.folder.mkdir(parents=True, exist_ok=True)
        stacks = self.folder / f"stacks_step{running.step}_{running.phase}.txt"
        found = self.collect()
        write_stacks(stacks, running, found)
        line = hang_line(running, elapsed, found, stacks)
        print(f"[megarl] {line}", file=sys.stderr, flush=True)
        stopped = next((s for s in found if s.stopped), None)
        written, why = self._checkpoint(running, stopped)
        (self.folder / "hang.json").write_text(json.dumps({
            "step": running.step, "phase": running.phase, "deadline_s": running.deadline_s, "elapsed_s": elapsed,
            "stacks": str(stacks), "checkpoint": written, "exit_code": REQUEUE_EXIT,
            "stopped": dataclasses.asdict(stopped.process) if stopped else None,
            "ranks": [{**dataclasses.asdict(s.process), "state": s.state, "stack_source": s.source} for s in found]},
            indent=1))
        print(f"[megarl] watchdog: {why}; stopping the run with exit code {REQUEUE_EXIT} (launch/slurm requeues it; "
              f"checkpoint.resume=auto resumes it)", file=sys.stderr, flush=True)
        self._shut_down()

    def collect(self) -> list[RankStack]:
        """Every armed rank's state and stack: this node's read here, other nodes' by a Ray task on
        that node (the stack files and /proc are node-local)."""
        here = {"", _driver_node_id()}
        local = [p for p in self.ranks if p.node_id in here or p.host == socket.gethostname()]
        if os.environ.get("MEGARL_WATCHDOG_VIA_RAY") == "1":   # every Ray rank as if on another node (tests)
            local = [p for p in local if not p.node_id]
        remote: dict[str, list[RankProcess]] = {}
        for p in self.ranks:
            if p not in local:
                remote.setdefault(p.node_id, []).append(p)
        found = {p: s for s in inspect_ranks(local, self.dump_wait_s) for p in [s.process]}
        for node, procs in remote.items():
            for s in _inspect_on_node(node, procs, self.dump_wait_s):
                found[s.process] = s
        return [found[p] for p in self.ranks]

    def _checkpoint(self, running: _Running, stopped: Optional[RankStack]) -> tuple[Optional[str], str]:
        """(the checkpoint written or None, the reason in words)."""
        if stopped is not None:
            p = stopped.process
            return None, (f"no checkpoint written: {p.role} rank {p.rank} cannot join its role's collectives, "
                          "which a checkpoint needs")
        if running.phase not in IDLE_RANK_PHASES:
            return None, (f"no checkpoint written: the ranks are inside the hung {running.phase} pass and "
                          "take no other call")
        if self.checkpoint is None:
            return None, "no checkpoint written (none registered)"
        ok, result = _bounded(lambda: self.checkpoint(running.phase), self.deadlines.of("checkpoint"))
        if not ok:
            return None, f"no checkpoint written: writing it failed ({result})"
        return str(result), f"checkpoint of the last finished step written to {result}"

    def _shut_down(self) -> None:
        """Kill the ranks (a stopped rank never answers a shutdown call; SIGKILL also ends a stopped
        process), then let the trainer stop its servers and the rest, bounded."""
        try:
            import ray

            for actor in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
        except ImportError:
            pass
        if self.close is not None:
            _bounded(self.close, CLOSE_S)
        if self.end_children:
            _end_children()


def _end_children(grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, to every process this driver still has below it (a checkpoint
    writer's manager, reward workers, a server the close did not reach): ``os._exit`` runs no
    atexit hook, and a child left behind keeps the job's output pipes open."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def write_stacks(path: Path, running: _Running, found: list[RankStack]) -> None:
    """The stacks file: a header, the driver's threads, then one section per rank."""
    with open(path, "w") as f:
        f.write(f"# megarl watchdog: step {running.step} phase {running.phase}, deadline {running.deadline_s:.0f}s, "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n\n")
        f.write(f"== driver on host {socket.gethostname()} (pid {os.getpid()})\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        for s in found:
            p = s.process
            f.write(f"\n== {p.role} rank {p.rank} on host {p.host} (pid {p.pid}) state {s.state} "
                    f"[stack from {s.source}, read by pid {s.reader}]\n{s.stack.rstrip()}\n")


def _driver_node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - no Ray: every rank is in this process
        return ""


def _inspect_on_node(node_id: str, procs: list[RankProcess], wait_s: float) -> list[RankStack]:
    """:func:`inspect_ranks` on another node, as a Ray task pinned there (no CPU reserved: the
    node's CPUs are its ranks')."""
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0)(inspect_ranks).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False))
        return ray.get(task.remote(procs, wait_s), timeout=wait_s + 90)
    except Exception as err:  # noqa: BLE001 - the node may be what hung: say so per rank
        why = f"(no Python stack: node {node_id[:12]} did not answer: {type(err).__name__}: {err})"
        return [RankStack(p, "unknown (its node did not answer)", why, "none") for p in procs]


def _bounded(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """``fn()`` on another thread for at most ``timeout_s``: (True, result) or (False, why). A call
    still running then is left behind; the process ends right after."""
    pool = cf.ThreadPoolExecutor(1, thread_name_prefix="megarl-watchdog-call")
    try:
        return True, pool.submit(fn).result(timeout_s)
    except cf.TimeoutError:
        return False, f"still running after {timeout_s:.0f}s"
    except Exception as err:  # noqa: BLE001 - reported in the hang's line
        return False, f"{type(err).__name__}: {err}"
    finally:
        pool.shutdown(wait=False)
