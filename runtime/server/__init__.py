"""`python -m runtime serve`: an OpenAI-compatible HTTP server that many clients share.

app.py routes requests to the scheduler (runtime/scheduler.py); protocol.py holds the request
models and their ranges; guard.py the body cap, Host check and API key; host.py loads the
model while /health answers 503; metrics.py the Prometheus metrics."""
from __future__ import annotations

import sys
import threading

from .guard import LOOPBACK_NAMES, is_loopback
from .host import ModelHost, ServeConfig


def serve(cfg: ServeConfig, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          cors_origins=(), metrics: bool = False, max_body: int = 8 << 20, say=None) -> int:
    import uvicorn
    from .app import create_app
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    if not is_loopback(host) and not api_key:
        say("=" * 78 + f"\nWARNING: serving on {host} with no API key: anyone who can reach this machine can\n"
            "use the model (and its CPU/GPU). Pass --api-key or --api-key-file, or bind 127.0.0.1.\n" + "=" * 78)
    mh = ModelHost(cfg, announce=say)
    from .metrics import Metrics
    app = create_app(mh, api_key=api_key, allowed_hosts=LOOPBACK_NAMES | {host} if is_loopback(host) else None,
                     cors_origins=cors_origins, metrics=Metrics(mh) if metrics else None, max_body=max_body)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))

    def announce_when_ready():
        mh.load()
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if mh.error is None and server.started:
            sock = server.servers[0].sockets[0].getsockname()
            name = f"[{sock[0]}]" if ":" in sock[0] else sock[0]
            say(f"Llamba is serving {mh.model_id} at http://{name}:{sock[1]}/v1")
    threading.Thread(target=announce_when_ready, name="llamba-load", daemon=True).start()
    try:
        server.run()
    finally:
        mh.shutdown()
    return 0 if mh.error is None else 1
