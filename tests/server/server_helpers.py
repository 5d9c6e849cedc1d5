"""Running real servers for the tests: in-process (uvicorn in a thread, real HTTP on 127.0.0.1) or
as a `blockspec serve` subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.server.app import create_app
from blockspec.server.launch import bind_socket, uvicorn_server
from blockspec.server.server_config import ServerConfig
from blockspec.server.serving import ServerState

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def tiny_engine_config(model: Path, drafter: Path | None = None, k: int = 4, **overrides: Any) -> EngineConfig:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if drafter else SpeculativeConfig()
    return EngineConfig(model=str(model), speculative=spec, **overrides)


def start_server(engine_config: EngineConfig | Callable[[], Any], wait_ready: bool = True,
                 **server_options: Any) -> RunningServer:
    """Serve on a free port of 127.0.0.1 from a thread; `engine_config` may be an engine factory."""
    from blockspec.engine.engine import Engine

    factory = engine_config if callable(engine_config) else (lambda: Engine(engine_config))
    options = {"served_model_names": ["tiny"], "model_root": "tiny", "uvicorn_log_level": "warning",
               "access_log": False, **server_options}
    config = ServerConfig(**options)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = create_app(config, factory)
    server = uvicorn_server(app, config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    running = RunningServer(f"http://127.0.0.1:{port}", app, server, thread)
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    if wait_ready:
        wait_healthy(running.base_url)
    return running


def wait_healthy(base_url: str, timeout: float = 120, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not become healthy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_subprocess(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m blockspec.cli serve ARGS` with stderr/stdout captured, on one torch thread as conftest's
    one_torch_thread runs the in-process engines: with two OpenMP threads beside the test's clients on a 2-core
    machine, any other load made the real-model server tests up to 10x slower (2 of 8 full CPU runs, +90-115 s)."""
    return subprocess.Popen([sys.executable, "-m", "blockspec.cli", "serve", *args], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def stop_subprocess(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    """SIGTERM, wait, and return (exit code, everything it printed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -9, out
    return proc.returncode, out


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0.0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, label_text = head.partition("{")
        if sample != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return 0.0


def sse_events(lines: list[str]) -> list[Any]:
    """The JSON payloads of an SSE body (without the final [DONE])."""
    import json

    events = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events
