"""Continuous batching through HTTP: concurrent streams equal solo runs, bad requests disturb nothing,
and a client that disconnects frees its KV blocks at once."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.server.server_helpers import metric, sse_events


def _chat(i: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"request {i}: " + "ab" * i}],
            "max_tokens": 12, "temperature": 0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, list[int]]:
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        events = sse_events([line async for line in r.aiter_lines()])
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert events[-1]["usage"]["completion_tokens"] == len(ids)
    return text, ids


BAD_REQUESTS = [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 7}, 400),
    ({"model": "tiny", "messages": []}, 400),
    ({"model": "tiny", "prompt": "x"}, 400),  # a completion body sent to chat: no messages
]


def test_16_concurrent_streams_equal_solo_runs_and_bad_requests_disturb_nothing(tiny_server):
    url = tiny_server.v1 + "/chat/completions"

    async def run() -> tuple[list, list, list]:
        async with httpx.AsyncClient(timeout=120) as client:
            solo = [await _stream(client, url, _chat(i)) for i in range(16)]
            streams = [asyncio.create_task(_stream(client, url, _chat(i))) for i in range(16)]
            await asyncio.sleep(0.05)
            bad = [await client.post(url, json=body) for body, _ in BAD_REQUESTS]
            bad.append(await client.post(url, content=b'{"model": "tiny", "messages": [', headers={
                "content-type": "application/json"}))
            return solo, await asyncio.gather(*streams), bad

    solo, together, bad = asyncio.run(run())
    assert together == solo
    assert all(len(ids) >= 1 for _, ids in solo)
    assert [r.status_code for r in bad] == [status for _, status in BAD_REQUESTS] + [400]
    for r in bad:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code


def _wait_idle(base_url: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(base_url + "/metrics").text
        idle = metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
        if idle and metric(text, "vllm:kv_cache_usage_perc") == 0:
            return text
        if time.monotonic() > deadline:
            pytest.fail("the aborted request still holds KV blocks:\n" + text)
        time.sleep(0.05)


# Four long samples: generation takes seconds, disconnect detection milliseconds.
LONG = {"model": "tiny", "max_tokens": 400, "ignore_eos": True, "temperature": 0.5, "n": 4}


def test_streaming_client_disconnect_aborts_and_frees_blocks(tiny_server):
    before = _wait_idle(tiny_server.base_url)
    body = {**LONG, "messages": [{"role": "user", "content": "long"}], "stream": True}
    with httpx.stream("POST", tiny_server.v1 + "/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept referenced: a dropped line iterator would close the connection
        chunks = 0
        for line in lines:
            chunks += line.startswith("data: ")
            if chunks == 8:
                break
        during = httpx.get(tiny_server.base_url + "/metrics").text  # the stream is still open
        assert metric(during, "vllm:num_requests_running") == 4
        assert metric(during, "vllm:kv_cache_usage_perc") > 0
    # leaving the block closed the connection
    after = _wait_idle(tiny_server.base_url)
    aborted = metric(after, "vllm:request_success_total", finished_reason="abort")
    assert aborted == metric(before, "vllm:request_success_total", finished_reason="abort") + 4
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert generated < 4 * 400


def test_non_streaming_client_disconnect_aborts_and_frees_blocks(tiny_server):
    before = _wait_idle(tiny_server.base_url)
    body = {**LONG, "prompt": "long"}
    errors: list[Exception] = []

    def call() -> None:
        try:
            httpx.post(tiny_server.v1 + "/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
        except httpx.ReadTimeout as exc:  # the client gives up and closes the connection
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(30)
    assert errors, "the request finished before the client gave up"
    after = _wait_idle(tiny_server.base_url)
    assert metric(after, "vllm:request_success_total", finished_reason="abort") == \
        metric(before, "vllm:request_success_total", finished_reason="abort") + 4
