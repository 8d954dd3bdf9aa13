"""Self-healing rollout: a dead or hung rollout server is started again on its placement, given
the current weights, and put back into service while the step's unfinished generations go on.

Why: one crashed SGLang process (an OOM, a CUDA error, a killed node process) used to end a run
of hours with `NoServerLeft`, or to leave it on fewer servers for the rest of the run.

Who decides what:

* :class:`megarl.rollout.manager.RolloutManager` decides that a server is gone: a request failed
  (connection refused, no answer within ``rollout.request_timeout_s``, a 5xx) and the server does
  not answer ``/health`` on a connection of its own within the probe's deadline (a hung server
  does neither). It sends the failed requests to the live servers, calls
  :meth:`ServerHealer.revive` off its event loop, and puts the server back when that returns its
  new URL (or waits for it when no server is left). A step ends only once every restart it
  started is over, so no weight push of the trainer runs concurrently with a restart's push.
* :meth:`ServerHealer.revive` restarts it (:meth:`megarl.rollout.launch.RolloutServers.restart`:
  the same host actors, hence the same Ray bundles and node; its whole process group is killed
  first, stopped processes included; a fresh port) and hands it the current weights through
  ``push_weights`` (the trainer: a weight-update session on that server alone, and a fresh update
  group per pipeline stage for it alone). Restarts are counted per server: after
  ``rollout.max_restarts`` of them, or when a restart fails that often, it raises
  :class:`RolloutServerLost`, which the trainer turns into a checkpoint and a clear error.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from megarl.metrics_log import note

log = logging.getLogger("megarl.rollout.healing")


class RolloutServerLost(RuntimeError):
    """A rollout server is gone and cannot be restarted (``rollout.max_restarts`` used up)."""


class ServerHealer:
    """Restarts the run's servers (a :class:`megarl.rollout.launch.RolloutServers`) and pushes the
    current weights into each restarted one through ``push_weights(server_index)``."""

    def __init__(self, servers: Any, push_weights: Callable[[int], None], max_restarts: int):
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.servers = servers
        self.push_weights = push_weights
        self.max_restarts = int(max_restarts)
        self.restarts = [0] * len(servers.urls)      # restarts (attempts) per server, whole run
        self._lock = threading.Lock()                # one restart at a time: each pushes through the actor ranks

    @property
    def total(self) -> int:
        return sum(self.restarts)

    def revive(self, server: int) -> str:
        """Restart server ``server`` and give it the current weights; its new URL. Raises
        :class:`RolloutServerLost` once its restarts are used up."""
        with self._lock:
            url = self.servers.urls[server]
            errors: list[str] = []
            while self.restarts[server] < self.max_restarts:
                self.restarts[server] += 1
                attempt = self.restarts[server]
                try:
                    new_url = self.servers.restart(server)
                    self.push_weights(server)
                except Exception as e:  # noqa: BLE001 - any failure of a restart counts as one attempt
                    errors.append(f"restart {attempt}: {type(e).__name__}: {str(e)[:500]}")
                    log.warning("rollout server %d (%s): %s", server, url, errors[-1])
                    continue
                note(f"rollout server {server} restarted ({attempt}/{self.max_restarts}) at {new_url} with the "
                     f"current weights (was {url})")
                return new_url
            raise RolloutServerLost(
                f"rollout server {server} ({url}) is gone and was restarted {self.restarts[server]} time(s) already "
                f"(rollout.max_restarts = {self.max_restarts})" + (f": {'; '.join(errors)}" if errors else ""))
