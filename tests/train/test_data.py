"""Data generation through the Engine: shards on disk, response masks, resuming."""

from __future__ import annotations

import pytest

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.errors import ConfigError
from blockspec.train.data import GenerationConfig, data_complete, generate_data, load_samples, shard_path
from blockspec.train.prompts import TrainPrompt

PROMPTS = [TrainPrompt(f"p{i}", "test", [{"role": "user", "content": t}]) for i, t in
           enumerate(["one two", "abc", "hello there", "x"])]


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(EngineConfig(model=str(tiny_models["llama_tied"]), device="cpu", max_num_seqs=8, max_model_len=96))


def test_generate_store_and_resume(engine, tmp_path, monkeypatch):
    cfg = GenerationConfig(num_samples=10, response_len=12, temperature=0.9, shard_size=4)
    data = tmp_path / "data"
    generate_data(engine, PROMPTS, cfg, data)
    assert [shard_path(data, s).is_file() for s in range(3)] == [True, True, True]
    samples = load_samples(data)
    assert len(samples) == 10
    texts = [engine.apply_chat_template(p.messages) for p in PROMPTS]
    greedy = engine.generate(texts, SamplingParams(temperature=0, max_tokens=12))
    for i, s in enumerate(samples):
        prompt = engine.encode(texts[i % 4])
        n = len(prompt)
        assert s.ids[:n].tolist() == prompt and not s.mask[:n].any() and s.mask[n:].all()
        if i < 4:  # the first pass over the prompts is greedy
            assert s.ids[n:].tolist() == greedy[i].token_ids
    assert data_complete(data, cfg)

    def refuse(*args, **kwargs):
        raise AssertionError("finished shards must not be regenerated")

    monkeypatch.setattr(engine, "add_request", refuse)
    generate_data(engine, PROMPTS, cfg, data)  # nothing to do
    monkeypatch.undo()

    more = GenerationConfig(num_samples=12, response_len=12, temperature=0.9, shard_size=4)
    assert not data_complete(data, more)
    before = shard_path(data, 0).stat().st_mtime_ns
    generate_data(engine, PROMPTS, more, data)  # only the short last shard is redone
    assert shard_path(data, 0).stat().st_mtime_ns == before
    assert len(load_samples(data)) == 12 and len(load_samples(data, limit=5)) == 5

    with pytest.raises(ConfigError, match="response_len"):
        generate_data(engine, PROMPTS, GenerationConfig(num_samples=4, response_len=8, shard_size=4), data)


def test_later_passes_sample_a_lead_in_then_continue_greedily(tiny_models, tmp_path):
    """After the greedy pass, a sample is its seeded lead-in plus the greedy continuation of it."""
    # the untied tiny model: its next-token distributions are flat enough for sampling to vary
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_num_seqs=8, max_model_len=96))
    lead = 3
    cfg = GenerationConfig(num_samples=8, response_len=12, temperature=1.5, sampled_prefix=lead, shard_size=8)
    samples = load_samples(generate_data(engine, PROMPTS, cfg, tmp_path / "data"))
    texts = [engine.apply_chat_template(p.messages) for p in PROMPTS]
    for i, s in enumerate(samples[4:], start=4):
        prompt = engine.encode(texts[i % 4])
        resp = s.ids[len(prompt):].tolist()
        assert s.mask[len(prompt):].all() and 1 <= len(resp) <= 12
        if len(resp) <= lead:
            continue  # the lead-in itself ended the answer
        rest = engine.generate([prompt + resp[:lead]], SamplingParams(temperature=0, max_tokens=12 - lead))[0]
        assert resp[lead:] == rest.token_ids
    # a different seed's lead-ins give different answers (the point of sampling them)
    other = GenerationConfig(num_samples=8, response_len=12, temperature=1.5, sampled_prefix=lead, shard_size=8,
                             seed=1)
    again = load_samples(generate_data(engine, PROMPTS, other, tmp_path / "other"))
    assert any(a.ids.tolist() != b.ids.tolist() for a, b in zip(samples[4:], again[4:]))


def test_self_prompted_samples_answer_a_message_the_target_wrote(tiny_models, tmp_path):
    """Self-prompting: after the greedy pass, a share of samples answers (greedily) a user message that
    starts with one of our openers and continues with text the target sampled."""
    from blockspec.train.data import is_self_prompted
    from blockspec.train.prompts import openers

    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_num_seqs=8, max_model_len=160))
    cfg = GenerationConfig(num_samples=16, response_len=10, temperature=1.0, self_prompts=0.5, self_prompt_len=12,
                           shard_size=16)
    samples = load_samples(generate_data(engine, PROMPTS, cfg, tmp_path / "data"))
    own = [i for i in range(16) if is_self_prompted(i, len(PROMPTS), cfg)]
    assert own and all(i >= len(PROMPTS) for i in own) and len(own) < 12
    texts = [o.text for o in openers()]
    builtin = {p.messages[0]["content"] for p in PROMPTS}
    written = 0
    for i in own:
        s = samples[i]
        prompt = s.ids[~s.mask].tolist()
        text = engine.tokenizer.decode(prompt)
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
        message = text[len("<|im_start|>user\n"):-len("<|im_end|>\n<|im_start|>assistant\n")]
        if message in builtin:  # the opener did not fit max_model_len: the sample kept its own prompt
            continue
        written += 1
        opener = next(t for t in texts if message.startswith(t))
        assert len(message) > len(opener)  # the target wrote the rest
        answer = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
        assert s.ids[s.mask].tolist() == answer.token_ids  # answered greedily throughout
    assert written >= 2
    again = load_samples(generate_data(engine, PROMPTS, cfg, tmp_path / "again"))
    assert [s.ids.tolist() for s in again] == [s.ids.tolist() for s in samples]  # seeded: reproducible
