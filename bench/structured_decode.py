"""Speculative decoding under a JSON schema: tau and tok/s with and without the grammar (issue 15).

The embedded SmolLM2-135M-Instruct with its shipped DFlash drafter, greedy, batch 1, each prompt with
a schema written for it. Per mode (free text, json_object, json_schema) and k (0 = autoregressive, and
the drafter's k): tau (tokens committed per verify step), decode tok/s, output tokens, and whether the
output validates against the schema. CPU figures are the default here (fp32; a shared machine makes
tok/s noisy: the load average is recorded); on a GPU pass --device cuda.

Usage: python bench/structured_decode.py [--device cpu] [--k 15] [--max-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jsonschema
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.loader.default_model import default_drafter_dir, default_model_dir
from blockspec.structured.spec import StructuredSpec

ITEM = {"type": "object", "properties": {"name": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                                         "unit_price": {"type": "number"}},
        "required": ["name", "quantity", "unit_price"]}
PROMPTS = [
    ("person", "Describe a fictional software engineer as JSON with name, age, city and skills.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "city": {"type": "string"}, "skills": {"type": "array",
                                                                               "items": {"type": "string"}}},
      "required": ["name", "age", "city", "skills"]}),
    ("order", "Extract the order as JSON: Maria Lopez ordered two blue mugs at 12.50 each and one teapot for 34.00 "
              "(order 88213).",
     {"type": "object", "properties": {"customer": {"type": "string"}, "order_id": {"type": "integer"},
                                       "items": {"type": "array", "items": ITEM}},
      "required": ["customer", "order_id", "items"]}),
    ("weather", "Give today's weather report for Paris as JSON.",
     {"type": "object", "properties": {"city": {"type": "string"}, "temperature_c": {"type": "number"},
                                       "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                                       "wind_kmh": {"type": "integer"}},
      "required": ["city", "temperature_c", "condition", "wind_kmh"]}),
    ("book", "Recommend a classic novel as JSON with title, author, year and a short summary.",
     {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                       "year": {"type": "integer"}, "summary": {"type": "string"}},
      "required": ["title", "author", "year", "summary"]}),
    ("config", "Write a JSON configuration for a web server with host, port, workers and a debug flag.",
     {"type": "object", "properties": {"host": {"type": "string"}, "port": {"type": "integer"},
                                       "workers": {"type": "integer"}, "debug": {"type": "boolean"}},
      "required": ["host", "port", "workers", "debug"]}),
]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_mode(engine: Engine, mode: str, max_tokens: int) -> dict:
    rows = []
    for name, text, schema in PROMPTS:
        structured = {"free": None, "json_object": StructuredSpec("json_object"),
                      "json_schema": StructuredSpec("json_schema", schema)}[mode]
        prompt = engine.apply_chat_template([{"role": "user", "content": text}])
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured))[0]
        valid = None
        if mode != "free":
            try:
                value = json.loads(out.text)
                if mode == "json_schema":
                    jsonschema.validate(value, schema)
                valid = True
            except (json.JSONDecodeError, jsonschema.ValidationError):
                valid = False
        rows.append({"prompt": name, "tokens": len(out.token_ids), "steps": out.stats.steps,
                     "tau": round(out.stats.tau, 3), "decode_tok_s": round(out.stats.decode_tok_s, 2),
                     "finish_reason": out.finish_reason, "valid": valid, "text": out.text})
    steps = sum(r["steps"] for r in rows)
    decode_tokens = sum(r["tokens"] - 1 for r in rows)  # the first token comes from the prefill
    return {"tau": round(decode_tokens / steps, 3) if steps else 0.0,
            "decode_tok_s_median": round(statistics.median(r["decode_tok_s"] for r in rows), 2),
            "tokens": sum(r["tokens"] for r in rows),
            "stopped": sum(r["finish_reason"] == "stop" for r in rows),  # the rest ran into max_tokens
            "valid": sum(bool(r["valid"]) for r in rows) if mode != "free" else None,
            "prompts": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default="bench/results/structured_decode_cpu.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SpeculativeConfig(model=str(default_drafter_dir()), num_speculative_tokens=args.k)
    engine = Engine(EngineConfig(model=str(default_model_dir()), device=args.device, speculative=spec,
                                 max_model_len=1024))
    engine.generate(["warm up"], SamplingParams(temperature=0, max_tokens=8))
    results = {"commit": commit(), "device": args.device,
               "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch threads {torch.get_num_threads()}",
               "dtype": str(engine.dtype).removeprefix("torch."), "model": "SmolLM2-135M-Instruct (embedded)",
               "drafter": "blockspec/drafters/smollm2-135m-instruct", "max_tokens": args.max_tokens,
               "batch": 1, "greedy": True, "load_average_start": os.getloadavg()[0], "runs": {}}
    started = time.perf_counter()
    for k in (args.k, 0):
        engine.set_num_speculative_tokens(k)
        for mode in ("free", "json_object", "json_schema"):
            r = run_mode(engine, mode, args.max_tokens)
            results["runs"][f"k{k}_{mode}"] = r
            print(f"k={k:2d} {mode:12s} tau {r['tau']:5.2f}  decode {r['decode_tok_s_median']:7.1f} tok/s  "
                  f"tokens {r['tokens']:4d}  stopped {r['stopped']}  valid {r['valid']}", flush=True)
    for mode in ("free", "json_object", "json_schema"):
        spec_r, ar_r = results["runs"][f"k{args.k}_{mode}"], results["runs"][f"k0_{mode}"]
        results["runs"][f"k{args.k}_{mode}"]["speedup_vs_ar"] = round(
            spec_r["decode_tok_s_median"] / ar_r["decode_tok_s_median"], 2) if ar_r["decode_tok_s_median"] else None
    results["load_average_end"] = os.getloadavg()[0]
    results["wall_s"] = round(time.perf_counter() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
