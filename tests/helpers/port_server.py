"""A stand-in server process for the launcher's port handling: real uvicorn on ``--host`` /
``--port`` (every path answers 200, /health too). When the port is taken, uvicorn logs its own bind
error and this process stays alive serving nothing -- as SGLang does, whose scheduler processes keep
it running after uvicorn gives up. Every other flag megarl appends is ignored."""
from __future__ import annotations

import argparse
import sys
import time

import uvicorn


async def app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    a, _ = ap.parse_known_args()
    try:
        uvicorn.run(app, host=a.host, port=a.port, lifespan="off", log_level="info")
    except SystemExit:   # uvicorn's exit after a failed bind
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
