"""megarl embedded rollout server: a real inference server process speaking the SGLang native API
subset (see megarl/rollout/protocol.py).  Run: `python -m megarl.rollout.server MODEL --port P`."""
from .cli import serve_main  # noqa: F401
