"""Prefix caching through the engine (tiny Qwen3 + tiny DFlash drafter, fp32, CPU).

Every output with the cache on equals the output of the same request run alone with the cache off:
greedy and seeded sampling, prompts that share whole blocks or part inside one, under preemption,
an abort and the eviction of blocks, and with DFlash: a hit gives the drafter the very context it
would have computed, so each step drafts the same tokens and accepts the same number of them.
"""

from __future__ import annotations

import pytest

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

SYSTEM = "You are a careful assistant. Tools: search(q), open(url), run(code). Answer briefly. "  # 84 bytes
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def engine_for(models, drafter=None, k=7, **overrides) -> Engine:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if drafter else SpeculativeConfig()
    return Engine(EngineConfig(model=str(models["qwen3"]), device="cpu", speculative=spec, **overrides))


class DraftLog:
    """The drafter's proposals, step by step (what its logits pick), recorded from the real drafter."""

    def __init__(self, engine: Engine) -> None:
        self.steps: list[list[int]] = []
        drafter = engine.runner.proposer
        compute = drafter.compute_logits

        def recording(hidden, weight):
            logits = compute(hidden, weight)
            self.steps.append(logits.argmax(-1).flatten().tolist())
            return logits

        drafter.compute_logits = recording

    def take(self) -> list[list[int]]:
        steps, self.steps = self.steps, []
        return steps


def test_a_hit_keeps_every_draft_and_acceptance_of_dflash(tiny_models, tiny_drafter):
    prompts = [SYSTEM + "Q: what is 2+2?", SYSTEM + "Q: name a colour.", SYSTEM + "Q: what is 2+2?"]
    alone = engine_for(tiny_models, tiny_drafter, enable_prefix_caching=False)
    alone_log = DraftLog(alone)
    cached = engine_for(tiny_models, tiny_drafter)
    cached_log = DraftLog(cached)
    hits = []
    for prompt in prompts:
        want = alone.generate([prompt], GREEDY)[0]
        want_drafts = alone_log.take()
        got = cached.generate([prompt], GREEDY)[0]
        assert got.token_ids == want.token_ids
        assert cached_log.take() == want_drafts  # same context K/V: the same proposals at every step
        assert got.stats.accepted_per_position == want.stats.accepted_per_position
        assert got.stats.steps == want.stats.steps
        hits.append(got.stats.cached_tokens)
    n = len(cached.encode(prompts[0]))
    assert hits == [0, 80, (n - 1) // 16 * 16]  # the shared system prompt's 5 full blocks; then all but the end
    assert cached.prefix_cache_stats.hits == sum(hits)
    assert cached.prefix_cache_stats.queries == sum(len(cached.encode(p)) for p in prompts)
    assert alone.prefix_cache_stats.queries == 0


def test_the_shipped_drafter_accepts_the_same_on_a_hit(default_model):
    """SmolLM2-135M with its trained drafter (real acceptance, tau ~4): a request that starts on the cached
    system prompt drafts, accepts and outputs what the same request computed whole does."""
    from blockspec.loader.default_model import default_drafter_dir

    spec = SpeculativeConfig(model=str(default_drafter_dir()), num_speculative_tokens=7)
    engine = Engine(EngineConfig(model=str(default_model), device="cpu", speculative=spec, max_model_len=128))
    log = DraftLog(engine)
    system = [{"role": "system", "content": "You are a helpful coding assistant. Answer with short Python code."}]
    first, second = (engine.apply_chat_template(system + [{"role": "user", "content": q}])
                     for q in ("Write a function that adds two numbers.", "Write a function that reverses a string."))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.generate([first], SamplingParams(temperature=0, max_tokens=1))
    log.take()
    hit = engine.generate([second], params)[0]
    hit_drafts = log.take()
    engine.allocator.reset_cache()
    whole = engine.generate([second], params)[0]
    assert hit.stats.cached_tokens > 0 and whole.stats.cached_tokens == 0
    assert hit.token_ids == whole.token_ids and hit_drafts == log.take()
    assert hit.stats.accepted_per_position == whole.stats.accepted_per_position
    assert hit.stats.tau == whole.stats.tau > 2  # the drafter really is accepted


def test_a_one_token_request_leaves_its_prompt_cached_for_the_drafter_too(tiny_models, tiny_drafter):
    engine = engine_for(tiny_models, tiny_drafter)
    prompt = SYSTEM + "Q: and now?"
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    again = engine.generate([prompt], GREEDY)[0]
    assert again.stats.cached_tokens == (len(engine.encode(prompt)) - 1) // 16 * 16
    assert again.token_ids == engine_for(tiny_models, tiny_drafter, enable_prefix_caching=False).generate(
        [prompt], GREEDY)[0].token_ids


def test_blocks_wait_for_their_drafter_context(tiny_models, tiny_drafter):
    """A prompt's features reach the drafter's cache one step after its prefill: a sequence preempted in
    between leaves its blocks without drafter context, and none of them may be shared."""
    from blockspec.engine.scheduler import SchedulerOutput

    engine = engine_for(tiny_models, tiny_drafter)
    engine.add_request("a", SYSTEM + "Q: one", GREEDY)
    engine.step()  # the whole prompt: target K/V written, drafter context still pending
    engine.scheduler._preempt(engine.requests["a"], SchedulerOutput())
    assert engine.allocator.num_cached == 0
    engine.abort_request("a")
    log = DraftLog(engine)
    got = engine.generate([SYSTEM + "Q: two"], GREEDY)[0]
    alone = engine_for(tiny_models, tiny_drafter, enable_prefix_caching=False)
    alone_log = DraftLog(alone)
    assert got.token_ids == alone.generate([SYSTEM + "Q: two"], GREEDY)[0].token_ids
    assert log.take() == alone_log.take()


def test_changing_k_drops_the_cache(tiny_models, tiny_drafter):
    engine = engine_for(tiny_models, tiny_drafter)
    engine.generate([SYSTEM], GREEDY)
    assert engine.allocator.num_cached > 0
    engine.set_num_speculative_tokens(0)  # blocks cached from now on hold no drafter context
    assert engine.allocator.num_cached == 0 and not engine.allocator.tracks_drafter
    engine.generate([SYSTEM], GREEDY)
    assert engine.allocator.num_cached > 0
    engine.reset_prefix_cache()  # after weights change in place (drafter training's evaluations do)
    assert engine.allocator.num_cached == 0


def run_together(engine: Engine, requests: list[tuple[str, SamplingParams]], abort_after: dict[str, int]
                 ) -> dict[str, list[int]]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
        for rid, at in abort_after.items():
            if steps == at:
                assert engine.abort_request(rid)
    return done


@pytest.mark.parametrize("drafts", [0, 5])
def test_outputs_equal_the_uncached_ones_under_pressure(tiny_models, tiny_drafter, monkeypatch, drafts):
    """Shared prefixes (whole blocks, and parting inside a block), greedy and seeded sampling, a KV cache
    small enough to preempt and to evict cached blocks, and an abort of a request that shares blocks."""
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)
    requests = [(SYSTEM + "Q: one", GREEDY), (SYSTEM + "Q: two", sampled), (SYSTEM[:40] + "other words", GREEDY),
                (SYSTEM + "Q: one", SamplingParams(temperature=0.7, seed=9, max_tokens=30, ignore_eos=True)),
                ("unrelated prompt " * 4, GREEDY), (SYSTEM + "Q: two", GREEDY), (SYSTEM + "Q: abort me", GREEDY)]
    reference = engine_for(tiny_models, tiny_drafter if drafts else None, k=drafts, enable_prefix_caching=False)
    want = {f"r{i}": reference.generate([p], params)[0].token_ids for i, (p, params) in enumerate(requests[:-1])}
    # 24 blocks of K/V for 7 sequences of up to ~120 tokens (8 blocks each): preemption and eviction
    per_block = 16 * 6 * 2 * 2 * 16 * 4 + (16 * 2 * 2 * 2 * 16 * 4 if drafts else 0)
    engine = engine_for(tiny_models, tiny_drafter if drafts else None, k=drafts, max_num_batched_tokens=48,
                        max_model_len=128, kv_cache_memory=24 * per_block)
    preempted = []
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda seq, out: (preempted.append(seq), preempt(seq, out)))
    got = run_together(engine, requests, abort_after={"r6": 6})
    assert got == want
    stats = engine.prefix_cache_stats
    assert preempted and stats.hits > 0 and stats.evictions > 0
    assert engine.allocator.num_free == engine.allocator.num_blocks
