"""megarl embedded rollout server: a real inference server speaking the SGLang native API subset
(see megarl/wire/protocol.py), including SGLang 0.5.23's weight-update contract.
Run: `python -m megarl.engine MODEL --port P [--tp-size N] [--weights-dir DIR]`
(API key from $MEGARL_API_KEY).

Modules: cli (start-up), app (HTTP), auth (API key), session (weight-update sessions), engine
(continuous batching), model (one TP rank's decoder), shard (which slice a rank keeps), tp (rank
processes, lockstep calls), worker (what a rank does), follower (ranks 1..N-1), weights
(receive / verify / agree / apply), unpickle (exact allowlist for tensor payloads)."""
from .cli import serve_main  # noqa: F401
