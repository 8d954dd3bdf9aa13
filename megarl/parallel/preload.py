"""Imported by a forkserver before it forks its children (``launcher.spawn`` sets it; so does
``tests/conftest.py`` for the test session): megatron and transformers are imported once, in the
server, instead of once per rank. A module of its own because the forkserver gives up on a preload
module only on ImportError; ``_preload`` ignores any failure, as the ``fork`` path does."""
from megarl.parallel.launcher import PRELOAD, _preload

_preload(PRELOAD)
