"""Token-mask time per token of the two well-kept grammar engines (xgrammar, llguidance), on our vocabularies.

Constrained decoding fills a token bitmask for every decoded and every verified position (k + 1 per DFlash
step), on the host, before the sampler can use it: its cost adds to each step. This times, per engine and
vocabulary, for JSON schemas and json_object:
  - compiling the grammar for the tokenizer (cold, then a cache hit is the engines' own business);
  - filling the mask at each position of a valid document, token by token (mean, p50, p99, max);
  - the DFlash verify pattern: from each position, the masks of the next k + 1 positions along the
    document (advance k tokens, then roll back), per step.
Vocabularies: SmolLM2's 49,152-token byte-level BPE (the embedded model) and a Qwen-size one: no Qwen
tokenizer ships in any installed package, so a byte-level BPE with Qwen2's pre-tokenizer and vocabulary
size (151,643 + Qwen's 22 special tokens, mask width 151,936 like Qwen3's embedding) is trained once on the
Python sources of the installed packages (about a minute, cached).

Usage: python bench/grammar_mask.py [--out bench/results/grammar_mask_cpu.json] [--k 15]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {"type": "array", "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                               "price": {"type": "number"}},
                "required": ["sku", "qty", "price"]}},
            "note": {"type": ["string", "null"]},
        },
        "required": ["id", "status", "items"],
    },
    "json_object": None,
}
DOCUMENTS = {
    "person": '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}',
    "order": '{"id": 1042, "status": "shipped", "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, '
             '{"sku": "Z-9", "qty": 1, "price": 120.0}], "note": null}',
    "json_object": '{"title": "Notes", "tags": ["a", "b"], "count": 3, "nested": {"ok": true, "ratio": 0.25}}',
}
REPEATS = 5  # passes over each document (the first warms the engines' caches)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                 "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>"]


def smollm2_tokenizer():
    from blockspec.loader.default_model import default_model_dir
    from blockspec.loader.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir()), 49152


def qwen_size_tokenizer():
    """A byte-level BPE of Qwen2's shape, trained once on installed Python sources (cached)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from blockspec.loader.cache import cache_root

    out = cache_root() / "bench-bpe-151k"
    if not (out / "tokenizer.json").is_file():
        root = Path(torch.__file__).parent.parent  # site-packages
        files = sorted(p for ext in ("py", "md", "rst", "txt") for p in glob.glob(f"{root}/**/*.{ext}", recursive=True)
                       if os.path.getsize(p) < 2_000_000)
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=151643, min_frequency=1, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

        def texts():
            for p in files:
                with open(p, encoding="utf-8", errors="ignore") as f:
                    yield f.read()

        bpe.train_from_iterator(texts(), trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                       additional_special_tokens=QWEN_SPECIALS)
        fast.save_pretrained(out)
    return PreTrainedTokenizerFast.from_pretrained(out), 151936


def _stats(times: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {"mean_us": round(statistics.fmean(us), 1), "p50_us": round(us[len(us) // 2], 1),
            "p99_us": round(us[min(len(us) - 1, int(0.99 * len(us)))], 1), "max_us": round(us[-1], 1), "n": len(us)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, width):
        import xgrammar as xgr

        self.xgr = xgr
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=width, stop_token_ids=[tok.eos_token_id])
        self.tokenizer_s = time.perf_counter() - t
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, width)

    def compile(self, schema):
        return (self.compiler.compile_builtin_json_grammar() if schema is None
                else self.compiler.compile_json_schema(json.dumps(schema)))

    def matcher(self, compiled, rollback):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=rollback)

    def fill(self, m):
        m.fill_next_token_bitmask(self.mask)

    def accept(self, m, t):
        return m.accept_token(t)

    def rollback(self, m, n):
        m.rollback(n)


def _plain_byte_level(tok):
    """llguidance recognises a byte-level BPE by its decoder; the GGUF-converted SmolLM2 tokenizer wraps
    ByteLevel in a Sequence (ByteFallback, Fuse, Replace, ByteLevel), which it then reads as raw strings."""
    import copy

    from tokenizers import decoders

    decoder = json.loads(tok.backend_tokenizer.to_str())["decoder"]
    if decoder and decoder["type"] == "Sequence" and any(d["type"] == "ByteLevel" for d in decoder["decoders"]):
        tok = copy.deepcopy(tok)
        tok.backend_tokenizer.decoder = decoders.ByteLevel()
    return tok


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, width):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        t = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(_plain_byte_level(tok), n_vocab=width)
        self.tokenizer_s = time.perf_counter() - t
        self.mask = llguidance.torch.allocate_token_bitmask(1, width)
        self.fill_fn = llguidance.torch.fill_next_token_bitmask

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema if schema is not None else {"type": "object"}),
            defaults={"whitespace_flexible": True})
        return grammar

    def matcher(self, compiled, rollback):
        m = self.llg.LLMatcher(self.tok, compiled)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def fill(self, m):
        self.fill_fn(m, self.mask, 0)

    def accept(self, m, t):
        return m.consume_token(t)

    def rollback(self, m, n):
        m.rollback(n)


def measure(engine, tok, k: int) -> dict:
    out = {"tokenizer_info_s": round(engine.tokenizer_s, 3), "schemas": {}}
    for name, schema in SCHEMAS.items():
        ids = tok.encode(DOCUMENTS[name], add_special_tokens=False)
        t = time.perf_counter()
        compiled = engine.compile(schema)
        m = engine.matcher(compiled, k + 1)  # llguidance compiles lazily: the first matcher is part of it
        compile_s = time.perf_counter() - t
        per_token, per_step = [], []
        for _ in range(REPEATS):
            m = engine.matcher(compiled, k + 1)
            for tid in ids:
                t = time.perf_counter()
                engine.fill(m)
                per_token.append(time.perf_counter() - t)
                assert engine.accept(m, tid), f"{engine.name} rejected a valid {name} document"
        for _ in range(REPEATS):
            m = engine.matcher(compiled, k + 1)
            for i in range(len(ids)):
                path = ids[i:i + k]
                t = time.perf_counter()
                engine.fill(m)
                for tid in path:
                    engine.accept(m, tid)
                    engine.fill(m)
                if path:
                    engine.rollback(m, len(path))
                per_step.append(time.perf_counter() - t)
                engine.accept(m, ids[i])
        out["schemas"][name] = {"tokens": len(ids), "compile_s": round(compile_s, 4),
                                "mask_per_token": _stats(per_token),
                                f"verify_masks_per_step_k{k}": _stats(per_step)}
    return out


def summarize(results: dict, k: int) -> dict:
    """Per engine, the geometric means over vocabularies and schemas; the choice is the faster mask."""
    out = {}
    for engine in ("xgrammar", "llguidance"):
        rows = [r for entry in results["vocabularies"].values() for r in entry[engine]["schemas"].values()]

        def gmean(values: list[float]) -> float:
            return round(math.exp(statistics.fmean(math.log(v) for v in values)), 1)

        out[engine] = {"mask_per_token_mean_us": gmean([r["mask_per_token"]["mean_us"] for r in rows]),
                       f"verify_masks_per_step_k{k}_mean_us": gmean(
                           [r[f"verify_masks_per_step_k{k}"]["mean_us"] for r in rows]),
                       "compile_ms": gmean([r["compile_s"] * 1e3 for r in rows])}
    out["choice"] = min(("xgrammar", "llguidance"), key=lambda e: out[e]["mask_per_token_mean_us"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/grammar_mask_cpu.json")
    ap.add_argument("--k", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
                          f"{platform.system()} (CPU only)",
               "k": args.k, "vocabularies": {}}
    for vocab_name, load in (("smollm2_49k", smollm2_tokenizer), ("qwen_size_151k", qwen_size_tokenizer)):
        tok, width = load()
        entry = {"tokenizer_len": len(tok), "mask_width": width}
        for cls in (XGrammar, LLGuidance):
            entry[cls.name] = measure(cls(tok, width), tok, args.k)
        results["vocabularies"][vocab_name] = entry
    results["summary"] = summarize(results, args.k)
    for vocab_name, entry in results["vocabularies"].items():
        for engine in ("xgrammar", "llguidance"):
            for schema, r in entry[engine]["schemas"].items():
                print(f"{vocab_name:15s} {engine:10s} {schema:12s} compile {r['compile_s'] * 1e3:7.1f} ms  "
                      f"mask mean {r['mask_per_token']['mean_us']:7.1f} us p99 {r['mask_per_token']['p99_us']:7.1f} "
                      f"us  verify step (k={args.k}) mean {r[f'verify_masks_per_step_k{args.k}']['mean_us']:8.1f} us")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
