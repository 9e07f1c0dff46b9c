"""`python -m runtime serve`: an OpenAI-compatible HTTP server that many clients share.

app.py routes requests to the scheduler (runtime/scheduler.py); protocol.py holds the request
models and their ranges; guard.py the body cap, Host check and API key; host.py loads the
model while /health answers 503; metrics.py the Prometheus metrics.  `serve` runs it in the
foreground; `BackgroundServer` runs it in a daemon thread around a host whose engine is
loaded already (the desktop app's local server)."""
from __future__ import annotations

import sys
import threading
import time

from .guard import LOOPBACK_NAMES, is_loopback
from .host import ModelHost, ServeConfig


def make_server(mh: ModelHost, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
                cors_origins=(), metrics: bool = False, max_body: int = 8 << 20):
    """The uvicorn.Server of the OpenAI-compatible app around `mh` (not started)."""
    import uvicorn
    from .app import create_app
    from .metrics import Metrics
    app = create_app(mh, api_key=api_key, allowed_hosts=LOOPBACK_NAMES | {host} if is_loopback(host) else None,
                     cors_origins=cors_origins, metrics=Metrics(mh) if metrics else None, max_body=max_body)
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                         timeout_graceful_shutdown=5))


def base_url(server) -> str:
    """http://host:port/v1 of a started uvicorn.Server (the port it got, where it asked for 0)."""
    sock = server.servers[0].sockets[0].getsockname()
    name = f"[{sock[0]}]" if ":" in sock[0] else sock[0]
    return f"http://{name}:{sock[1]}/v1"


def serve(cfg: ServeConfig, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          cors_origins=(), metrics: bool = False, max_body: int = 8 << 20, say=None) -> int:
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    if not is_loopback(host) and not api_key:
        say("=" * 78 + f"\nWARNING: serving on {host} with no API key: anyone who can reach this machine can\n"
            "use the model (and its CPU/GPU). Pass --api-key or --api-key-file, or bind 127.0.0.1.\n" + "=" * 78)
    mh = ModelHost(cfg, announce=say)
    server = make_server(mh, host, port, api_key, cors_origins, metrics, max_body)

    def announce_when_ready():
        mh.load()
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if mh.error is None and server.started:
            say(f"Llamba is serving {mh.model_id} at {base_url(server)}")
    threading.Thread(target=announce_when_ready, name="llamba-load", daemon=True).start()
    try:
        server.run()
    finally:
        mh.shutdown()
    return 0 if mh.error is None else 1


class BackgroundServer:
    """The server in a daemon thread around a ready ModelHost (`ModelHost.from_engine`).

    `start` returns once the port is bound; `stop` refuses new requests (503), stops accepting
    connections, shuts the host's scheduler down (requests in flight end "cancelled", so their
    responses close) and waits for the thread: after it the engine is the caller's again."""

    def __init__(self, mh: ModelHost, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
                 **kwargs):
        self.host = mh
        self.server = make_server(mh, host, port, api_key, **kwargs)
        self.thread: threading.Thread | None = None
        self.url = ""
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as e:          # (a port in use exits through SystemExit)
            self.error = e

    def start(self, timeout: float = 15.0) -> str:
        self.thread = threading.Thread(target=self._run, name="llamba-http", daemon=True)
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started and self.thread.is_alive() and time.monotonic() < end:
            time.sleep(0.02)
        if not self.server.started:
            self.stop()
            why = self.error if self.error is not None and not isinstance(self.error, SystemExit) else None
            raise OSError(f"the server did not start on {self.server.config.host}:{self.server.config.port}"
                          + (f": {why}" if why else " (is the port in use?)"))
        self.url = base_url(self.server)
        return self.url

    def stop(self, timeout: float = 15.0) -> None:
        self.host.error = "the server is stopping"      # (_ready answers 503 from now on)
        self.server.should_exit = True
        self.host.shutdown()
        if self.thread is not None:
            self.thread.join(timeout)
