"""Entry point of TP ranks 1..N-1 of the embedded server (started by rank 0, `tp.Followers`).

    python -m megarl.engine.follower RANK OPTIONS_JSON

Builds this rank's shard (`worker.build_worker`), then runs rank 0's calls until told to stop
(`tp.follow`). Dies with rank 0 (`tp.die_with_parent`). Serves no socket of its own.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    import signal

    from .tp import die_with_parent
    die_with_parent()
    # Ctrl-C reaches the whole process group: rank 0 decides when the ranks stop (a `stop` call,
    # or SIGTERM), so a follower does not die on its own mid-collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    argv = sys.argv[1:] if argv is None else argv
    rank, opts_json = int(argv[0]), argv[1]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(name)s %(levelname)s %(message)s")
    from .tp import follow
    from .worker import RankOptions, build_worker
    opts = RankOptions(**json.loads(opts_json))
    worker = build_worker(opts, rank)
    logging.getLogger("megarl.engine").info("tp rank %d of %d ready", rank, opts.tp_size)
    follow(worker, worker.comm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
