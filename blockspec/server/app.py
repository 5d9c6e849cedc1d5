"""The FastAPI app: routes, auth, error handlers, and the engine worker's lifecycle.

The engine is built on its worker thread when the app starts, so the HTTP server is up at once
and answers 503 on model routes (and on /health) until the model is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from blockspec.errors import BlockspecError
from blockspec.server.async_engine import AsyncEngine, EngineState
from blockspec.server.auth import BearerAuth
from blockspec.server.errors import error_response, install_error_handlers
from blockspec.server.metrics import CONTENT_TYPE, ServerMetrics
from blockspec.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from blockspec.server.served_models import ServedModels, check_defaults, generation_config_defaults
from blockspec.server.server_config import ServerConfig
from blockspec.server.serving import ServerState, check_ready
from blockspec.server.serving_chat import create_chat_completion
from blockspec.server.serving_completion import create_completion
from blockspec.server.stats_log import log_stats_forever

log = logging.getLogger("blockspec.server")

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 503)}


def blockspec_version() -> str:
    try:
        return version("blockspec")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def create_app(config: ServerConfig, engine_factory: Callable[[], Any],
               on_engine_state: Callable[[EngineState, BaseException | None], None] | None = None) -> FastAPI:
    """`engine_factory` builds the Engine on the worker thread; `on_engine_state` hears READY/FAILED."""
    models = ServedModels(config.served_model_names, config.aliases)

    def engine_state(state: EngineState, error: BaseException | None) -> None:
        if state is EngineState.READY:
            _set_defaults(engine, models, config)
            info = engine.info
            log.info("model loaded: serving %s (max_model_len %d, k=%d)", ", ".join(models.names),
                     info.max_model_len if info else 0, info.num_speculative_tokens if info else 0)
        elif state is EngineState.FAILED:
            if isinstance(error, BlockspecError):
                log.error("error: %s", error)
            else:
                log.error("the engine failed to load" if engine.info is None else "the engine stopped",
                          exc_info=error)
        if on_engine_state is not None:
            on_engine_state(state, error)

    engine = AsyncEngine(engine_factory, on_state=engine_state)
    metrics = ServerMetrics(engine, models.primary)
    state = ServerState(engine, models, metrics, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        stats = asyncio.create_task(log_stats_forever(engine, config.stats_interval_s)) if config.log_stats else None
        yield
        if stats is not None:
            stats.cancel()
        engine.shutdown()

    app = FastAPI(title="blockspec", version=blockspec_version(), lifespan=lifespan,
                  description="OpenAI-compatible server with DFlash speculative decoding")
    app.state.server = state
    install_error_handlers(app, on_error=metrics.observe_error)
    if config.api_keys:
        app.add_middleware(BearerAuth, api_keys=config.api_keys)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if engine.state is EngineState.READY:
            return Response(status_code=200)
        if engine.state is EngineState.LOADING:
            return error_response(503, "the model is still loading")
        return error_response(503, f"the engine is {engine.state.value}")

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": blockspec_version()}

    @app.get("/metrics", response_class=Response)
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def list_models() -> dict[str, Any]:
        check_ready(state)
        return {"object": "list", "data": [_model_card(name, engine, config) for name in models.names]}

    @app.get("/v1/models/{model_id:path}", responses=ERRORS)
    async def get_model(model_id: str) -> dict[str, Any]:
        check_ready(state)
        models.resolve(model_id)
        return _model_card(model_id, engine, config)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **ERRORS})
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, body, raw)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERRORS})
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, body, raw)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            list_served_names(default_openapi(), models.names)
        return app.openapi_schema

    app.openapi = openapi
    return app


def list_served_names(schema: dict[str, Any], names: list[str]) -> None:
    """State in the OpenAPI schema which `model` values this server answers (others are 404s)."""
    served = {"type": "string", "enum": list(names)}
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        schema["components"]["schemas"][request]["properties"]["model"] = {"anyOf": [served, {"type": "null"}],
                                                                           "title": "Model"}
    for parameter in schema["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
        if parameter["name"] == "model_id":
            parameter["schema"] = {**parameter["schema"], **served}


def _model_card(name: str, engine: AsyncEngine, config: ServerConfig) -> dict[str, Any]:
    info = engine.info
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "blockspec",
            "root": config.model_root, "parent": None, "max_model_len": info.max_model_len if info else 0}


def _set_defaults(engine: AsyncEngine, models: ServedModels, config: ServerConfig) -> None:
    """Sampling defaults from the loaded model's generation config, then --override-generation-config."""
    assert engine.info is not None
    try:
        defaults = generation_config_defaults(config.generation_config, engine.info.model_dir)
    except BlockspecError as exc:
        log.warning("warning: %s; using blockspec's defaults", exc)
        defaults = {}
    defaults.update(check_defaults(config.override_generation_config, "--override-generation-config"))
    if defaults:
        log.info("default sampling parameters: %s", ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    models.base_defaults = defaults

