"""Prompts the target answers to make the drafter's training data.

The drafter learns whatever the target writes, so the prompt set decides what it will be good at.
The built-in set is our own writing (blockspec/train/prompts.json), expanded from templates
and subjects into about two thousand chat prompts: code (tasks, function stubs to complete, SQL,
shell), step-by-step math, dialogue, prose and JSON. It deliberately contains no HumanEval task and
none of the benchmark prompts in blockspec/bench/data, so both stay fair held-out evaluations.
Users add their own JSONL (one {"prompt": ...} or {"messages": [...]} per line).
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError

MATH_VARIANTS = 8  # random instantiations of each math template


@dataclass
class TrainPrompt:
    id: str
    prompt_class: str
    messages: list[dict[str, str]]


@dataclass
class Opener:
    """The start of a user message that the target finishes itself (self-prompting): a few hundred
    hand-written prompts become thousands of different ones, in the target's own words. `stop` ends
    the sampled part (e.g. a code fence), `close` is appended after it."""

    prompt_class: str
    text: str
    stop: str | None = None
    close: str = ""
    weight: float = 1.0  # relative chance of being picked (function stubs: coding assistants' main task)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@functools.cache
def _builtin_data() -> dict[str, Any]:
    """prompts.json, read once (callers only read it; generation asks for the openers every wave)."""
    return json.loads(resources.files("blockspec.train").joinpath("prompts.json").read_text())


def _code(d: dict[str, Any]) -> list[TrainPrompt]:
    out = [TrainPrompt(f"code-{i}-{j}", "code", _user(t.format(s=s)))
           for i, s in enumerate(d["code"]["subjects"]) for j, t in enumerate(d["code"]["templates"])]
    out += [TrainPrompt(f"code-misc-{i}", "code", _user(t)) for i, t in enumerate(d["sql_shell"])]
    out += [TrainPrompt(f"code-stub-{i}-{j}", "code", _user(f"{inst}\n\n```python\n{stub}```"))
            for i, stub in enumerate(d["code_stubs"]) for j, inst in enumerate(d["code_instructions"])]
    return out


def _math(d: dict[str, Any], rng: random.Random) -> list[TrainPrompt]:
    m = d["math"]
    out = []
    for i, tpl in enumerate(m["templates"]):
        for j in range(MATH_VARIANTS):
            values = {k: rng.randint(lo, hi) for k, (lo, hi) in tpl["ranges"].items()}
            text = f"{tpl['text'].format(**values)} {rng.choice(m['suffixes'])}"
            out.append(TrainPrompt(f"math-{i}-{j}", "math", _user(text)))
    out += [TrainPrompt(f"math-q-{i}", "math", _user(q)) for i, q in enumerate(m["questions"])]
    return out


def _dialogue(d: dict[str, Any]) -> list[TrainPrompt]:
    out = []
    systems = d["dialogue_systems"]
    for i, q in enumerate(d["dialogue_questions"]):
        out.append(TrainPrompt(f"dialogue-{i}", "dialogue", _user(q)))
        system = {"role": "system", "content": systems[i % len(systems)]}
        out.append(TrainPrompt(f"dialogue-sys-{i}", "dialogue", [system, *_user(q)]))
    return out


def _prose(d: dict[str, Any]) -> list[TrainPrompt]:
    out = [TrainPrompt(f"prose-{i}-{j}", "prose", _user(f.format(s=s)))
           for i, s in enumerate(d["prose_subjects"]) for j, f in enumerate(d["prose_forms"])]
    return out + [TrainPrompt(f"prose-task-{i}", "prose", _user(t)) for i, t in enumerate(d["prose_tasks"])]


def _json(d: dict[str, Any]) -> list[TrainPrompt]:
    out = [TrainPrompt(f"json-{i}-{j}", "json", _user(t.format(s=s)))
           for i, s in enumerate(d["json_subjects"]) for j, t in enumerate(d["json_templates"])]
    return out + [TrainPrompt(f"json-task-{i}", "json", _user(t)) for i, t in enumerate(d["json_tasks"])]


def builtin_prompts(seed: int = 0) -> list[TrainPrompt]:
    """The built-in training prompts, interleaved across classes (a prefix is still a mix)."""
    d = _builtin_data()
    rng = random.Random(seed)
    prompts, seen = [], set()
    for p in _code(d) + _math(d, rng) + _dialogue(d) + _prose(d) + _json(d):
        key = json.dumps(p.messages)
        if key not in seen:  # small number ranges can repeat a math problem
            seen.add(key)
            prompts.append(p)
    random.Random(seed).shuffle(prompts)
    return prompts


def openers() -> list[Opener]:
    """The built-in user-message openers for self-prompting (code weighted up: coding assistants)."""
    return [Opener(o["class"], o["text"], o.get("stop"), o.get("close", ""), float(o.get("weight", 1.0)))
            for o in _builtin_data()["self_prompt_openers"]]


def pick_opener(choices: list[Opener], rng: random.Random) -> Opener:
    """One opener, drawn by weight."""
    return rng.choices(choices, weights=[o.weight for o in choices])[0]


def read_prompt_file(path: Path) -> list[TrainPrompt]:
    """A user JSONL in the bench format: {"prompt": text} or {"messages": [...]}, optional "class"."""
    from blockspec.bench.prompts import read_jsonl

    if not path.is_file():
        raise ConfigError(f"prompt file {path} does not exist")
    return [TrainPrompt(p.id, p.prompt_class, p.messages) for p in read_jsonl(path, path.stem)]


def load_prompts(spec: str = "builtin", seed: int = 0) -> list[TrainPrompt]:
    """`--prompts`: comma-separated 'builtin' and/or JSONL files."""
    prompts: list[TrainPrompt] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        prompts += builtin_prompts(seed) if item == "builtin" else read_prompt_file(Path(item).expanduser())
    if not prompts:
        raise ConfigError("--prompts selected no prompts: use 'builtin' or a JSONL file")
    return prompts


def split_heldout(prompts: list[TrainPrompt], count: int) -> tuple[list[TrainPrompt], list[TrainPrompt]]:
    """Set aside `count` prompts, spread over the list, for the periodic tau evaluation."""
    if count <= 0:
        return prompts, []
    if count * 4 > len(prompts):
        raise ConfigError(f"--eval-prompts {count} would hold out more than a quarter of the {len(prompts)} "
                          "prompts: lower it or add prompts")
    stride = len(prompts) // count
    held = set(range(0, stride * count, stride))
    return ([p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held])
