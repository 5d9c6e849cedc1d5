"""Batch-1 greedy decode of a quantized shape, vLLM (the peer: ../shared/peers/vllm/STAGE.md installs it into
/tmp/vsite) against blockspec, each in its own process on the same config.json with random weights in the real
format (bench/hybrid_gpu.py's compressed-tensors NVFP4 / int4 g128 exports; vLLM's load_format "dummy" and ours
draw them). Issue 14 asks for a share of the bandwidth roofline; this says where the peer stands on the same
bytes. Decode tok/s = 128 / (t(129 new tokens) - t(1 new token)), median of 3 after a warm-up, from a prompt of
1,024 random ids (the issue's context). One JSON line `RESULT {...}` a run; --out collects them.

  python bench/peer_quant.py --write-config /root/cfg/8b_nvfp4 --model 8b --quant nvfp4
  PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 python bench/peer_quant.py vllm /root/cfg/8b_nvfp4
  python bench/peer_quant.py blockspec /root/cfg/8b_nvfp4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_gpu  # noqa: E402 -- the bench's shapes and quantization configs

PROMPT = 1024
NEW = 128


def write_config(path: Path, key: str, quant: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hybrid_gpu.model_config(key, False, quant), indent=1))


def vllm_generate(model: str, wrapped: bool):
    """`wrapped`: a vision-language wrapper's config (text_config, as the hybrids publish theirs): the text model
    alone, as blockspec serves it (a bare config directory has no image processor)."""
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    llm = LLM(model=model, dtype="bfloat16", max_model_len=PROMPT + NEW + 64, gpu_memory_utilization=0.8,
              enable_prefix_caching=False, seed=0, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=1,
              **({"language_model_only": True} if wrapped else {}))

    def gen(prompt: list[int], n: int) -> list[int]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        return list(llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0].token_ids)
    return gen


def blockspec_generate(model: str):
    from blockspec.config import EngineConfig  # noqa: PLC0415
    from blockspec.engine.engine import Engine  # noqa: PLC0415
    from blockspec.engine.sampling_params import SamplingParams  # noqa: PLC0415

    eng = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_model_len=PROMPT + NEW + 64,
                              max_num_seqs=1, load_format="dummy", gpu_memory_utilization=0.8))

    def gen(prompt: list[int], n: int) -> list[int]:
        return list(eng.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids)
    return gen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", nargs="?", choices=("vllm", "blockspec"))
    ap.add_argument("model", nargs="?", help="a directory holding the config.json")
    ap.add_argument("--write-config", type=Path, help="write the config.json of --model / --quant there and exit")
    ap.add_argument("--model-key", "--model", dest="key", default="8b")
    ap.add_argument("--quant", default="nvfp4", choices=("nvfp4", "int4"))
    args = ap.parse_args()
    if args.write_config:
        write_config(args.write_config, args.key, args.quant)
        return
    if not (args.engine and args.model):
        ap.error("ENGINE MODEL_DIR, or --write-config")
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    prompt = torch.randint(100, min(30000, vocab - 1), (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    t0 = time.time()
    gen = vllm_generate(args.model, "text_config" in cfg) if args.engine == "vllm" else blockspec_generate(args.model)
    startup = time.time() - t0

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        gen(prompt, n)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(NEW + 1)
    timed(1)
    runs = []
    for _ in range(3):
        t1 = timed(1)
        runs.append(NEW / (timed(NEW + 1) - t1))
    print("RESULT " + json.dumps(dict(
        engine=args.engine, model=args.model, quant=cfg.get("quantization_config", {}).get("format"),
        device=torch.cuda.get_device_name(), prompt=PROMPT, new=NEW, startup_s=round(startup, 1),
        decode_tok_s=round(statistics.median(runs), 1), runs=[round(r, 1) for r in runs])), flush=True)


if __name__ == "__main__":
    main()
