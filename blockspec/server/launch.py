"""Running the app under uvicorn: bind first (a busy port fails at once, before any model load),
then serve until SIGINT/SIGTERM, then shut down cleanly and exit 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from blockspec.errors import BlockspecError, ConfigError
from blockspec.server.app import create_app
from blockspec.server.async_engine import EngineState
from blockspec.server.server_config import ServerConfig

log = logging.getLogger("blockspec.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for host:port (port 0: any free port), or a ConfigError that says why not."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} does not resolve ({exc.strerror}): "
                          "use an IP address such as 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port or stop the "
                          "process that holds it") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a signal first ends the running requests (streams get an error event
    and [DONE]), so connections close and the process exits at once, not after the grace period."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        state = getattr(getattr(self.config.app, "state", None), "server", None)
        if state is not None:
            state.engine.drain()


def uvicorn_server(app: Any, config: ServerConfig) -> uvicorn.Server:
    return _Server(uvicorn.Config(app, log_level=config.uvicorn_log_level, access_log=config.access_log,
                                  timeout_graceful_shutdown=config.graceful_shutdown_s, lifespan="on"))


@contextlib.contextmanager
def _exit_on_signals(server: uvicorn.Server) -> Iterator[None]:
    """Handlers under uvicorn's own: uvicorn re-raises the signal that stopped it once it has shut down
    gracefully, and the default SIGTERM action would then kill us with status -15 instead of 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_sig: int, _frame: Any) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(config: ServerConfig, engine_factory: Any, sock: socket.socket) -> int:
    """Serve until a signal (exit 0) or until the model fails to load (exit 2 with its message)."""
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_state(state: EngineState, error: BaseException | None) -> None:
        if state is EngineState.FAILED and server is not None:
            failure.append(error or RuntimeError("the engine failed to load"))
            server.should_exit = True

    app = create_app(config, engine_factory, on_state)
    server = uvicorn_server(app, config)
    host, port = sock.getsockname()[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    log.info("blockspec: serving %s on http://%s:%d/v1 (model loading; /health answers 200 when ready)",
             ", ".join(config.served_model_names + [a for a in config.aliases if a not in config.served_model_names]),
             shown, port)
    with _exit_on_signals(server):
        server.run(sockets=[sock])
    code = (2 if isinstance(failure[0], BlockspecError) else 1) if failure else 0
    if app.state.server.engine.state is EngineState.LOADING:
        # Stopped while the weights load: that thread cannot be interrupted, and letting the
        # interpreter finalize under it aborts the process (C++ terminate). Leave at once instead.
        log.info("stopped while the model was loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
