"""Hybrid and MoE targets on the GPU (issue 6, point 6): random weights in the real shapes.

Models: Qwen3.6-27B (dense Gated DeltaNet hybrid) and Qwen3.6-35B-A3B (MoE hybrid), built from the
text_config values of their published config.json (CONFIGS below; Qwen3.6 ships the qwen3_5 /
qwen3_5_moe architectures with the Qwen3.5 shapes). Nothing here is an assumed value except the
context length of the measurement (--context, default 1024 tokens of random ids).

In one run, bf16, batch 1:
  checks  - fla-core's delta-rule kernels against the plain-PyTorch reference (real head shapes);
          - grouped-GEMM MoE against the per-expert reference loop (256 experts, top-8, real sizes);
          - a 4-layer hybrid with real head shapes through prefill, decode and verify+commit (both
            rollback modes): fla backend vs reference backend logits.
  per model (CUDA graph of the target forward; the state commit runs eagerly after it):
          - AR step: 1 token, forward + logits + argmax -> tok/s, against the roofline
            (measured copy bandwidth / bytes of the weights one token reads: for MoE the top-k experts);
          - verify step, k in {7, 11, 15}: k + 1 tokens + commit, for both ways of rolling the
            recurrent state back (replay: re-run the accepted tokens at commit; checkpoint: keep the
            state after every position, copy at commit), committing all k + 1 (the dearest case);
            reported as a multiple of the AR step;
          - the AR step without graphs (eager), for scale.
  MoE routing is random (a uniform router), so a (k+1)-token verify step reads more distinct experts
  than real router statistics would make it read: the MoE verify ratios are an upper bound.

Prints a table and writes hybrid_gpu.json to --out DIR (default $OUT, else bench/results).

Usage (repository root, on the GPU machine):
    python bench/hybrid_gpu.py [--models 27b,35b] [--context 1024] [--out DIR]
fla-core is not in the GPU image: carry its wheel (pure Python; Triton and einops are there):
    python -m pip download --no-deps -d .whl fla-core==0.6.0        # here, once
    pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-0.6.0-*.whl && \\
        PYTHONPATH=/tmp/site:. python bench/hybrid_gpu.py             # there
The 35B-A3B needs ~65 GiB of weights: an H200 (or an H100 with little else on it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockspec.engine.engine import build_module  # noqa: E402
from blockspec.models.layers import delta_rule, delta_rule_fla  # noqa: E402
from blockspec.models.layers.attention import AttentionMetadata, forward_context  # noqa: E402
from blockspec.models.layers.moe import experts_grouped, experts_reference, route  # noqa: E402
from blockspec.models.layers.recurrent_state import StateMetadata  # noqa: E402
from blockspec.models.model_config import ModelConfig  # noqa: E402
from blockspec.models.registry import model_class  # noqa: E402
from blockspec.runner.model_runner import ModelRunner  # noqa: E402

HYBRID_TEXT = {
    "vocab_size": 248320, "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "mamba_ssm_dtype": "float32", "hidden_act": "silu", "attention_bias": False,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
}
CONFIGS = {
    "27b": {"name": "Qwen3.6-27B", "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": {**HYBRID_TEXT, "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
                            "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4,
                            "linear_num_value_heads": 48}},
    "35b": {"name": "Qwen3.6-35B-A3B", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": {**HYBRID_TEXT, "model_type": "qwen3_5_moe_text", "hidden_size": 2048,
                            "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                            "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}},
}
KS = (7, 11, 15)
DTYPE = torch.bfloat16
DEV = torch.device("cuda")


# ---- timing -----------------------------------------------------------------------------------

def timed(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a), iters=10)


def capture(fn):
    """A CUDA graph of fn (warmed up on a side stream); returns (replay, the graph's outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def graph_or_eager(fn, notes: list[str]):
    """fn's CUDA graph replay, or fn itself when capture fails (the failure goes into notes)."""
    try:
        return capture(fn)[0], "graph"
    except Exception as exc:
        notes.append(f"graph capture failed, timed eagerly: {type(exc).__name__}: {exc}"[:300])
        torch.cuda.synchronize()
        fn()
        return fn, "eager"


# ---- model ------------------------------------------------------------------------------------

def init_random_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights that keep activations in range: N(0, 0.02) matrices, near-identity norms."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=DEV).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif "linear_attn.norm" in name:
                p.fill_(1.0)  # scale = weight
            elif "norm" in name:
                p.zero_()  # zero-centred: scale = 1 + weight
            else:
                p.normal_(0.0, 0.02, generator=gen)


def build(key: str, context: int):
    cfg = ModelConfig.from_dict(CONFIGS[key])
    cls = model_class(cfg)
    model = build_module(lambda: cls(cfg, max_positions=context + 64), DEV, DTYPE)
    init_random_(model)
    runner = ModelRunner(model, None, DEV, DTYPE, block_size=16)
    runner.allocate_kv_cache(-(-(context + 32) // 16))
    return cfg, model, runner


def weight_bytes(model, cfg: ModelConfig) -> tuple[int, int]:
    """(resident weight bytes, bytes one batch-1 decode token reads: one embedding row, top-k experts)."""
    total = active = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        total += n
        if name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            n = p.shape[1] * p.element_size()
        elif ".experts." in name:
            n = n * cfg.moe.top_k // cfg.moe.num_experts
        active += n
    return total, active


def step_metadata(start: int, q: int, speculative: bool) -> AttentionMetadata:
    """One sequence whose block table is the identity (slot = position), q new tokens at `start`."""
    ar = torch.arange(start + q, device=DEV)
    qpos = ar[start:]
    meta = AttentionMetadata(slot_mapping=qpos.clone(), query_index=torch.arange(q, device=DEV)[None],
                             query_unpad=torch.arange(q, device=DEV), kv_slots=ar[None],
                             mask=(ar[None, :] <= qpos[:, None])[None, None])
    meta.state = StateMetadata(starts=[0], lengths=[q], slots=[0], has_state=[start > 0], speculative=[speculative],
                               device=DEV)
    return meta


class _Slot0:
    state_slot = 0


def measure_model(key: str, context: int, bandwidth: float) -> dict:
    t0 = time.perf_counter()
    cfg, model, runner = build(key, context)
    total, active = weight_bytes(model, cfg)
    layers = model.state_layers
    res = {"model": CONFIGS[key]["name"], "config": CONFIGS[key]["text_config"], "context": context,
           "weight_bytes": total, "active_bytes_per_token": active, "build_s": round(time.perf_counter() - t0, 1)}
    state_seq = model.state_bytes_per_seq(0)
    kv_token = sum(2 * a.num_kv_heads * a.head_dim * 2 for a in model.attention_layers)
    res["state_bytes_per_seq"] = state_seq
    res["kv_bytes_read_per_step"] = kv_token * context
    res["roofline_tok_s"] = bandwidth / active
    res["roofline_with_state_kv_tok_s"] = bandwidth / (active + 2 * state_seq + kv_token * context)

    gen = torch.Generator(device=DEV).manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (context + 16,), device=DEV, generator=gen)

    def run(meta, toks, pos):
        with forward_context(meta):
            hidden, _ = model(toks, pos)
        return model.compute_logits(hidden).argmax(-1)

    with torch.inference_mode():
        model.allocate_state(1)
        t = time.perf_counter()
        run(step_metadata(0, context, False), tokens[:context], torch.arange(context, device=DEV))
        torch.cuda.synchronize()
        res["prefill_s"] = round(time.perf_counter() - t, 3)  # includes Triton compilation on first use

        ar_meta, ar_pos = step_metadata(context, 1, False), torch.arange(context, context + 1, device=DEV)

        def ar_fn():
            return run(ar_meta, tokens[context:context + 1], ar_pos)

        notes = res["notes"] = []
        res["ar_eager_s"] = timed(ar_fn)
        replay, how = graph_or_eager(ar_fn, notes)
        res["ar_timing"] = how
        res["ar_graph_s"] = timed(replay)
        res["ar_tok_s"] = 1 / res["ar_graph_s"]
        res["ar_fraction_of_roofline"] = res["ar_tok_s"] / res["roofline_tok_s"]
        res["verify"] = {}
        for mode in ("replay", "checkpoint"):
            saved = {layer: layer.state for layer in layers}
            model.allocate_state(1, checkpoints=16 if mode == "checkpoint" else 0)
            for layer in layers:  # continue from the prefilled state
                layer.state.conv.copy_(saved[layer].conv)
                layer.state.ssm.copy_(saved[layer].ssm)
            for k in KS:
                q = k + 1
                meta = step_metadata(context, q, True)
                toks, pos = tokens[context:context + q], torch.arange(context, context + q, device=DEV)
                try:
                    replay, how = graph_or_eager(lambda meta=meta, toks=toks, pos=pos: run(meta, toks, pos), notes)
                    pending = {layer: layer.state.pending for layer in layers}

                    def commit(pending=pending, q=q):
                        for layer in layers:
                            layer.state.pending = pending[layer]
                        model.commit_state([_Slot0()], [q])

                    fwd = timed(replay)
                    step = timed(lambda replay=replay, commit=commit: (replay(), commit()))
                    res["verify"][f"{mode}_k{k}"] = {
                        "timing": how, "forward_s": fwd, "commit_s": timed(commit), "step_s": step,
                        "ratio_to_ar": step / res["ar_graph_s"], "forward_ratio_to_ar": fwd / res["ar_graph_s"]}
                except Exception as exc:  # keep the other measurements
                    res["verify"][f"{mode}_k{k}"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            model.allocate_state(1)
    return res


# ---- checks -----------------------------------------------------------------------------------

def check_delta_rule() -> dict:
    """fla vs reference at real head shapes (Hk 16, Hv 48, d 128), fp32 inputs, ragged spans."""
    out = {}
    lengths = [1, 16, 300]
    gen = torch.Generator(device=DEV).manual_seed(0)
    t = sum(lengths)
    q, k = (torch.randn(t, 16, 128, device=DEV, generator=gen) for _ in range(2))
    v = torch.randn(t, 48, 128, device=DEV, generator=gen)
    g = -torch.rand(t, 48, device=DEV, generator=gen) * 0.5
    beta = torch.rand(t, 48, device=DEV, generator=gen)
    s0 = torch.randn(3, 48, 128, 128, device=DEV, generator=gen) * 0.05
    cu = torch.tensor([0, 1, 17, t], device=DEV)
    for longest in (16, 300):  # recurrent kernel on the short spans only / chunk kernel for all
        idx = [0, 1] if longest == 16 else [0, 1, 2]
        o, final = delta_rule_fla.run(q, k, v, g, beta, s0[idx], cu[:len(idx) + 1], longest)
        err_o = err_s = 0.0
        for i in idx:
            a, b = cu[i].item(), cu[i + 1].item()
            qp, kp = delta_rule.prepare_qk(q[a:b], k[a:b], 48)
            want, s_n, _ = delta_rule.recurrent(qp, kp, v[a:b], g[a:b], beta[a:b], s0[i])
            err_o = max(err_o, (o[a:b].float() - want).abs().max().item() / want.abs().max().item())
            err_s = max(err_s, (final[i] - s_n).abs().max().item() / s_n.abs().max().item())
        out["recurrent_kernel" if longest == 16 else "chunk_kernel"] = {"max_rel_err_out": err_o,
                                                                         "max_rel_err_state": err_s}
    layout = [torch.tensor(x, device=DEV) for x in delta_rule_fla.prefix_layout([16])]
    states = delta_rule_fla.prefix_states(k[1:17], v[1:17], g[1:17], beta[1:17], s0[1:2], *layout)
    qp, kp = delta_rule.prepare_qk(q[1:17], k[1:17], 48)
    _, _, want = delta_rule.recurrent(qp, kp, v[1:17], g[1:17], beta[1:17], s0[1], keep_states=True)
    out["prefix_checkpoints"] = {"max_rel_err_state": (states - want).abs().max().item() / want.abs().max().item()}
    return out


def check_moe() -> dict:
    """Grouped GEMM vs the reference loop, 256 experts, top-8, H 2048, I 512, bf16; and their times."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    gate_up = torch.randn(256, 1024, 2048, device=DEV, dtype=DTYPE, generator=gen) * 0.02
    down = torch.randn(256, 2048, 512, device=DEV, dtype=DTYPE, generator=gen) * 0.02
    router = torch.randn(256, 2048, device=DEV, dtype=DTYPE, generator=gen) * 0.02
    out = {}
    for t in (1, 16, 512):
        x = torch.randn(t, 2048, device=DEV, dtype=DTYPE, generator=gen)
        w, ids = route(x @ router.t(), 8, True)
        ref = experts_reference(x, gate_up, down, w, ids)
        got = experts_grouped(x, gate_up, down, w, ids)
        out[f"tokens_{t}"] = {
            "max_rel_err": ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
            "distinct_experts": ids.unique().numel(),
            "grouped_s": timed(lambda x=x, w=w, ids=ids: experts_grouped(x, gate_up, down, w, ids)),
            "reference_s": timed(lambda x=x, w=w, ids=ids: experts_reference(x, gate_up, down, w, ids), iters=5),
        }
    return out


def check_hybrid_layers() -> dict:
    """4 layers with real head shapes (27B's): fla vs reference backend through the paged runner path."""
    cfg = dict(CONFIGS["27b"])
    cfg["text_config"] = {**cfg["text_config"], "num_hidden_layers": 4, "hidden_size": 1024,
                          "intermediate_size": 2048, "vocab_size": 4096}
    mcfg = ModelConfig.from_dict(cfg)
    model = build_module(lambda: model_class(mcfg)(mcfg, max_positions=512), DEV, DTYPE)
    init_random_(model, seed=3)
    runner = ModelRunner(model, None, DEV, DTYPE, block_size=16)
    runner.allocate_kv_cache(32)
    gen = torch.Generator(device=DEV).manual_seed(2)
    tokens = torch.randint(0, 4096, (300,), device=DEV, generator=gen)
    result = {}
    for mode in ("replay", "checkpoint"):
        logits = {}
        for backend in ("reference", "fla"):
            os.environ["BLOCKSPEC_GDN_BACKEND"] = backend
            model.allocate_state(1, checkpoints=16 if mode == "checkpoint" else 0)
            outs, pos = [], 0
            with torch.inference_mode():
                for q, spec, commit in [(200, False, 200), (1, False, 1), (16, True, 5), (8, True, 8), (16, True, 1)]:
                    meta = step_metadata(pos, q, spec)
                    with forward_context(meta):
                        hidden, _ = model(tokens[pos:pos + q], torch.arange(pos, pos + q, device=DEV))
                    outs.append(model.compute_logits(hidden[:commit]).float())
                    model.commit_state([_Slot0()], [q if not spec else commit])
                    pos += commit
            logits[backend] = torch.cat(outs)
        ref, got = logits["reference"], logits["fla"]
        result[mode] = {"max_abs_err": (got - ref).abs().max().item(), "logit_scale": ref.abs().max().item(),
                        "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    os.environ.pop("BLOCKSPEC_GDN_BACKEND", None)
    return result


def attempt(fn) -> dict:
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:600]}


# ---- report -----------------------------------------------------------------------------------

def table(results: dict) -> str:
    lines = [f"device {results['device']}, copy bandwidth {results['copy_bandwidth_GBps']:.0f} GB/s, "
             f"fla-core {results['fla_version']}, bf16, batch 1"]
    for m in results["models"]:
        if "error" in m:
            lines.append(f"{m.get('model', '?')}: ERROR {m['error']}")
            continue
        lines.append(f"\n{m['model']}: weights {m['weight_bytes'] / 1e9:.1f} GB, read per token "
                     f"{m['active_bytes_per_token'] / 1e9:.2f} GB, state {m['state_bytes_per_seq'] / 2**20:.0f} "
                     f"MiB/seq, context {m['context']}")
        lines.append(f"  AR: {m['ar_tok_s']:.1f} tok/s ({m['ar_timing']}; {1 / m['ar_eager_s']:.1f} eager) vs roofline "
                     f"{m['roofline_tok_s']:.1f} -> {100 * m['ar_fraction_of_roofline']:.0f}%")
        lines.append("  verify step / AR step (commit of all k+1 included):")
        lines.append("    k   replay (commit ms)   checkpoint (commit ms)")
        for k in KS:
            cells = []
            for mode in ("replay", "checkpoint"):
                v = m["verify"].get(f"{mode}_k{k}", {})
                cells.append("error" if "error" in v else f"{v['ratio_to_ar']:.2f}x ({1000 * v['commit_s']:.2f})")
            lines.append(f"   {k:2d}   {cells[0]:<19}  {cells[1]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="27b,35b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if not delta_rule_fla.available():
        sys.exit(f"fla-core is not importable: install fla-core=={delta_rule_fla.FLA_VERSION} (see --help)")
    import fla

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "fla_version": getattr(fla, "__version__", "?"), "commit": commit or "unknown",
               "copy_bandwidth_GBps": copy_bandwidth() / 1e9}
    bandwidth = results["copy_bandwidth_GBps"] * 1e9
    results["checks"] = {"delta_rule_fla_vs_reference": attempt(check_delta_rule),
                         "moe_grouped_vs_reference": attempt(check_moe),
                         "hybrid_layers_fla_vs_reference": attempt(check_hybrid_layers)}
    print(json.dumps(results["checks"], indent=1), flush=True)
    if "error" in results["checks"]["moe_grouped_vs_reference"]:
        os.environ["BLOCKSPEC_MOE_BACKEND"] = "reference"  # slow, and no CUDA graphs: the table will say so
        results["notes"] = ["grouped GEMM failed on this GPU: MoE timed with the reference loop"]
    results["models"] = []
    for key in args.models.split(","):
        print(f"measuring {CONFIGS[key]['name']} ...", flush=True)
        results["models"].append(attempt(lambda key=key: measure_model(key, args.context, bandwidth)))
        torch.cuda.empty_cache()  # the model is gone with measure_model's frame
        if "error" in results["models"][-1]:
            results["models"][-1]["model"] = CONFIGS[key]["name"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"wrote {out / 'hybrid_gpu.json'}")


if __name__ == "__main__":
    main()
