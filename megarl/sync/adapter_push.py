"""Driver side of adapter-only pushes (``actor.lora.push: adapter``): a LoRA actor's adapters to
every server through SGLang's LoRA API, the base staying where it is.

Why a driver-side push (not per rank like the merged push): the adapters are megabytes, already
gathered to full PEFT-named tensors by the actor ranks for the PEFT export
(``MegatronWorker.adapter_tensors``: TP shards all-gathered, one owner per pipeline stage), and
one ``/load_lora_adapter_from_tensors`` call needs all of them at once.

Each push loads the new version under its own name (``adapter_name(version)``), then points the
rollout requests at it (``servers.lora_name``, read by the rollout manager for every
``/generate``: SGLang's ``lora_path``), sets the servers' ``weight_version``, and only then
unloads the previous version -- a request in flight keeps a valid adapter (SGLang and the
embedded server both let a request finish under the adapter it was admitted with).

Two routes (``sync.transport``): ``disk`` writes a PEFT folder under the servers' weights folder
and calls ``/load_lora_adapter`` (any node that sees the folder); every other transport posts the
tensors by reference (CPU shared memory, ``file_system`` strategy): only to servers on the
trainer's node (``config.validate`` refuses more than one node).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megarl.rollout.client import LoopThread, SGLangClient
from megarl.sync.adapter import adapter_bytes, adapter_name, load_from_tensors_request
from megarl.sync.session import SyncError, close_clients, server_failures


class AdapterPush:
    """Loads each version's adapters on every server and retires the previous version."""

    def __init__(self, cfg: Any, actor: Any, servers: Any, model_dir: str):
        from megarl.models.lora import peft_config, spec_from_config

        self.actor, self.servers = actor, servers
        self.config = peft_config(spec_from_config(cfg.actor.lora), base_model=str(model_dir))
        self.disk = cfg.sync.transport == "disk"
        self.timeout_s = cfg.rollout.request_timeout_s
        self.current: Optional[str] = None     # the name every server holds and requests carry
        self._tensors: dict = {}

    def push(self, version: str) -> dict[str, float]:
        """Gather the adapters, load them as ``version`` on every server, switch, retire the old one."""
        from megarl.models.lora import gather_peft_tensors

        t0 = time.perf_counter()
        self._tensors = gather_peft_tensors(self.actor)
        name, old = adapter_name(version), self.current
        self._load(name, version, range(len(self.servers.urls)))
        self.current = self.servers.lora_name = name
        if old is not None and old != name:
            self._call(range(len(self.servers.urls)), lambda c, i: c.unload_lora_adapter(old), f"unload {old}")
            self._remove_folder(old)
        seconds = time.perf_counter() - t0
        total = adapter_bytes(self._tensors) * len(self.servers.urls)
        return {"sync/bytes": float(total), "sync/seconds": seconds,
                "sync/bytes_per_s": float(total / seconds) if seconds else 0.0}

    def push_to_restarted(self, server: int, version: str) -> None:
        """The current adapters into restarted server ``server`` (it loaded the base at start)."""
        if self.current is not None:
            self._load(self.current, version, [server])

    def _load(self, name: str, version: str, servers: Sequence[int]) -> None:
        if self.disk:
            folder = self._write_folder(name)
            self._call(servers, lambda c, i: c.load_lora_adapter(name, str(folder)), f"load {name}")
        else:
            import torch.multiprocessing as tmp

            tmp.set_sharing_strategy("file_system")   # a handle an unrelated process can open
            bodies = {i: load_from_tensors_request(name, self.config, self._tensors, self.servers.tp_sizes[i])
                      for i in servers}
            self._call(servers, lambda c, i: c.load_lora_adapter_from_tensors(bodies[i]), f"load {name}")
        self._call(servers, lambda c, i: c.update_weight_version(version), f"weight_version {version}")

    def _write_folder(self, name: str) -> Path:
        from megarl.models.lora import write_peft_folder

        folder = Path(self.servers.weights_dir) / "lora" / name
        if not folder.exists():
            tmp = folder.with_name("." + name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            write_peft_folder(tmp, self._tensors, self.config)
            tmp.rename(folder)
        return folder

    def _remove_folder(self, name: str) -> None:
        shutil.rmtree(Path(self.servers.weights_dir) / "lora" / name, ignore_errors=True)

    def _call(self, servers: Sequence[int], fn, what: str) -> None:
        """``fn(client, server index)`` on the given servers concurrently; one error line naming each server."""
        io = LoopThread()
        urls = self.servers.urls
        clients = {i: SGLangClient(urls[i], timeout_s=self.timeout_s, retries=0, api_key=self.servers.api_key)
                   for i in servers}
        try:
            futs = [io.submit(fn(c, i)) for i, c in clients.items()]
            errors = server_failures(list(clients.values()), futs, self.timeout_s)
            if errors:
                raise SyncError(f"LoRA adapter push ({what}) failed: " + "; ".join(errors)) from errors.first
        finally:
            close_clients(list(clients.values()), io)
