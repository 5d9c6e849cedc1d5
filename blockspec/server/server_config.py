"""Settings of the HTTP layer (the engine's own settings live in blockspec.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_root: str  # what /v1/models reports as `root`: the MODEL argument as given
    host: str = "0.0.0.0"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no auth
    aliases: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> default sampling params
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools) is allowed
    tool_call_parser: str | None = None  # how auto tool calls are read from the output
    generation_config: str = "auto"  # auto | vllm | folder holding generation_config.json
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    uvicorn_log_level: str = "info"
    access_log: bool = True
    graceful_shutdown_s: float = 5.0  # then streams still running are cancelled (and aborted)
    log_stats: bool = True  # a throughput / speculation line every stats_interval_s while busy
    stats_interval_s: float = 10.0
