"""Environment hubs trained as they are published, through the bring-your-own-agent gateway.

Each module here adapts one hub's environments to ``agent.entrypoint``: its ``run(base_url=,
api_key=, record=, **agent.entrypoint_args)`` plays one episode of the hub's environment against
megarl's OpenAI-compatible gateway (so every token is recorded as the servers sampled it) and
returns the environment's own reward; its ``export_records(out, **agent.entrypoint_args)`` writes
the environment's tasks as a JSONL dataset (``megarl hub export``). The hub packages are an extra
(``pip install 'megarl[hubs]'``), imported only when an adapter runs.
"""
from __future__ import annotations

HUBS = {
    "verifiers": "megarl.envs.hubs.verifiers_hub",
    "openenv": "megarl.envs.hubs.openenv_hub",
}
