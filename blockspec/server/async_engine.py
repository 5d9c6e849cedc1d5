"""The bridge between the asyncio server and the single-threaded engine.

One worker thread builds the engine (so the HTTP server answers 503 while the model loads) and is
then the only thread that ever touches it. The event loop talks to it through a thread-safe command
queue (add, abort, anything else as a function of the engine); step outputs travel back once per
step through `loop.call_soon_threadsafe` into per-request-group asyncio queues. The event loop
therefore never waits on model work, and the engine never sees two threads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from blockspec.engine.outputs import RequestOutput

log = logging.getLogger("blockspec.server")

T = TypeVar("T")
Command = Callable[[Any], None]


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class EngineUnavailable(Exception):
    """The engine cannot take requests now (still loading, failed to load, or shut down)."""

    def __init__(self, state: EngineState, detail: str = "") -> None:
        self.state = state
        super().__init__(detail or f"the engine is {state.value}")


class ShuttingDown(Exception):
    """The server received SIGINT/SIGTERM: running requests end now instead of holding up the exit."""


@dataclass(frozen=True)
class EngineInfo:
    """Facts about the loaded engine that the event loop may read freely (copied once after load)."""

    model_dir: Path
    max_model_len: int
    num_speculative_tokens: int


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine-wide numbers for /metrics, rebuilt by the worker after every step (an atomic swap)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # and found there


@dataclass
class Update:
    """One step's output for one engine request, plus the text of any logprob token ids."""

    index: int  # position of the request within its group (the choice index)
    output: RequestOutput | None
    token_text: dict[int, str] = field(default_factory=dict)
    error: BaseException | None = None  # the engine failed while running this request


class RequestGroup:
    """The engine requests of one API call (n choices x prompts), feeding one asyncio queue."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.queue: asyncio.Queue[Update] = asyncio.Queue()


class AsyncEngine:
    def __init__(self, factory: Callable[[], Any],
                 on_state: Callable[[EngineState, BaseException | None], None] | None = None) -> None:
        """`factory` builds the Engine (in the worker thread); `on_state` runs on the event loop."""
        self._factory = factory
        self._on_state = on_state
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._routes: dict[str, RequestGroup] = {}  # worker thread only
        self._token_text: dict[int, str] = {}  # worker thread only (decoded logprob tokens)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = False
        self._draining = False
        self.state = EngineState.LOADING
        self.error: BaseException | None = None
        self.info: EngineInfo | None = None
        self.snapshot = EngineSnapshot()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    # ---- lifecycle (event loop side) ----------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="blockspec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker after its current step; requests still running are dropped."""
        self._stop = True
        self._commands.put(None)
        if self._thread is not None and self.state is not EngineState.LOADING:
            self._thread.join(timeout)  # a thread still loading weights is a daemon: leave it

    def drain(self) -> None:
        """Thread-safe: refuse new requests and end the running ones (for a prompt, clean exit)."""
        self._draining = True
        if self.state is EngineState.READY:
            self._commands.put(lambda engine: self._fail_all(engine, ShuttingDown("the server is shutting down")))

    def check_ready(self) -> None:
        if self._draining:
            raise EngineUnavailable(self.state, "the server is shutting down")
        if self.state is EngineState.READY:
            return
        if self.state is EngineState.LOADING:
            raise EngineUnavailable(self.state, "the model is still loading: retry when /health returns 200")
        raise EngineUnavailable(self.state, f"the engine is {self.state.value}"
                                + (f": {self.error}" if self.error else ""))

    # ---- requests (event loop side) -----------------------------------------------------------

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run fn(engine) on the worker thread between two steps and return its result."""
        self.check_ready()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command(engine: Any) -> None:
            try:
                result = fn(engine)
            except BaseException as exc:  # delivered to the awaiting coroutine, not raised here
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self._publish(engine)  # /metrics never lags what the caller has been told
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(command)
        return await future

    async def add(self, group: RequestGroup,
                  prepare: Callable[[Any], tuple[list[tuple[str | list[int], Any]], T]]) -> T:
        """Add a group's requests, all or none.

        `prepare(engine)` runs on the worker (it may apply the chat template, tokenize, raise
        RequestError) and returns ((prompt, SamplingParams) per request id, extra); `extra`,
        e.g. prompt token counts, is returned here.
        """

        def add_all(engine: Any) -> T:
            items, extra = prepare(engine)
            added: list[str] = []
            try:
                for rid, (prompt, params) in zip(group.request_ids, items, strict=True):
                    self._routes[rid] = group
                    engine.add_request(rid, prompt, params)
                    added.append(rid)
            except BaseException:
                for rid in group.request_ids:
                    self._routes.pop(rid, None)
                for rid in added:
                    engine.abort_request(rid)
                raise
            return extra

        return await self.call(add_all)

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe and non-blocking: stop these requests and free their KV blocks."""

        def command(engine: Any) -> None:
            for rid in request_ids:
                if self._routes.pop(rid, None) is not None:
                    engine.abort_request(rid)

        if self.state is EngineState.READY:
            self._commands.put(command)

    # ---- the worker thread --------------------------------------------------------------------

    def _notify(self, state: EngineState, error: BaseException | None = None) -> None:
        """Switch state on the event loop, after `on_state` ran (e.g. sampling defaults are set
        before the first request can see READY)."""

        def apply() -> None:
            try:
                if self._on_state is not None:
                    self._on_state(state, error)
            finally:
                self.state, self.error = state, error

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(apply)
        else:
            self.state, self.error = state, error

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # reported to the server, which exits with the message
            self._notify(EngineState.FAILED, exc)
            return
        self.info = EngineInfo(model_dir=Path(engine.model_dir), max_model_len=engine.max_model_len,
                               num_speculative_tokens=engine.num_speculative_tokens)
        self._publish(engine)
        self._notify(EngineState.READY)
        try:
            while not self._stop:
                self._run_commands(engine, block=not engine.has_unfinished_requests())
                if self._stop:
                    break
                if engine.has_unfinished_requests():
                    self._step(engine)
                else:
                    self._publish(engine)  # after aborts
        except BaseException as exc:  # the loop itself broke: no request may wait forever
            log.exception("the engine worker stopped")
            self._fail_all(engine, exc)
            self._notify(EngineState.FAILED, exc)
            return
        self.state = EngineState.STOPPED

    def _run_commands(self, engine: Any, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while command is not None:
            try:
                command(engine)
            except Exception:  # a command's own failure must not stop the worker
                log.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
        self._stop = True

    def _step(self, engine: Any) -> None:
        try:
            outputs = engine.step()
        except Exception as exc:  # an engine bug: fail the running requests, keep serving
            log.exception("engine step failed; failing %d running requests", len(self._routes))
            self._fail_all(engine, exc)
            return
        batch: list[tuple[RequestGroup, Update]] = []
        for out in outputs:
            group = self._routes.get(out.request_id)
            if out.finished:
                self._routes.pop(out.request_id, None)
            self._generation_tokens += len(out.new_token_ids)
            if len(out.token_ids) == len(out.new_token_ids):  # the request's first output
                self._prompt_tokens += len(out.prompt_token_ids)
            if group is None:
                continue
            update = Update(group.index[out.request_id], out)
            if out.new_logprobs:
                update.token_text = self._decode_logprob_tokens(engine, out)
            batch.append((group, update))
        self._publish(engine)  # before the outputs reach clients, so /metrics is never behind them
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _fail_all(self, engine: Any, exc: Exception) -> None:
        batch = [(group, Update(group.index[rid], None, error=exc)) for rid, group in self._routes.items()]
        for rid in list(self._routes):
            try:
                engine.abort_request(rid)
            except Exception:
                log.exception("abort after a failed step failed for %s", rid)
        self._routes.clear()
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _decode_logprob_tokens(self, engine: Any, out: RequestOutput) -> dict[int, str]:
        ids = {lp.token_id for lp in out.new_logprobs or ()}
        ids.update(t for lp in out.new_logprobs or () for t, _ in lp.top)
        cache = self._token_text
        for t in ids:
            if t not in cache:
                if len(cache) > 100_000:
                    cache.clear()
                cache[t] = engine.tokenizer.decode([t], skip_special_tokens=False)
        return {t: cache[t] for t in ids}

    def _publish(self, engine: Any) -> None:
        c, cache = engine.spec_counters, engine.prefix_cache_stats
        self.snapshot = EngineSnapshot(
            num_running=engine.num_running, num_waiting=engine.num_waiting, kv_usage=float(engine.kv_usage),
            num_drafts=c.num_drafts, num_draft_tokens=c.num_draft_tokens, num_accepted_tokens=c.num_accepted_tokens,
            accepted_per_pos=tuple(c.accepted_per_pos), prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens, prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(batch: list[tuple[RequestGroup, Update]]) -> None:
    for group, update in batch:
        group.queue.put_nowait(update)
