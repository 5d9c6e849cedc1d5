"""`blockspec train-drafter` end to end: data, drafter set-up, training, export, model card.

Every stage leaves its result in the output directory (data/ shards, train_state.pt, config.json +
model.safetensors, train_log.jsonl, train_summary.json, README.md), so a stopped run picks up where
it was: data generation always resumes, training resumes with --resume.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.errors import ConfigError
from blockspec.loader.tokenizer import load_tokenizer
from blockspec.loader.weights import checkpoint_name, load_weights, resolve_model_path
from blockspec.models.model_config import ModelConfig
from blockspec.spec.dflash import DrafterConfig, dflash2_only
from blockspec.train.data import GenerationConfig, data_complete, generate_data, load_samples, token_counts
from blockspec.train.drafter_init import (
    build_training_drafter,
    copy_final_norm,
    identity_convolutions,
    parse_layer_ids,
    pick_mask_token,
)
from blockspec.train.evaluate import TauEvaluator, chat_texts
from blockspec.train.export import as_dflash2, drafter_config_json, save_drafter, write_model_card
from blockspec.train.parallel_data import GeneratorSpec, generate_parallel, kv_share
from blockspec.train.prompts import load_prompts, split_heldout
from blockspec.train.trainer import TrainConfig, Trainer, TrainResult

log = logging.getLogger("blockspec")
GIB = 1 << 30


@dataclass
class PipelineConfig:
    out: Path
    target: str | None = None  # None: the embedded default model
    prompts: str = "builtin"
    data_dir: Path | None = None  # default: out/data
    generation: GenerationConfig | None = None
    training: TrainConfig | None = None
    num_layers: int | None = None  # None: 2 for a fresh drafter, with init_from its own (fewer: its first layers)
    block_size: int = 16
    dflash2: dict[str, int] | None = None  # --arch dflash2: conv_kernel_size, conv_group_size, selector_*
    target_layer_ids: str | None = None  # "1,8,14,21,27"; None: 5 spread from 1 to L-3
    mask_token_id: int | None = None  # None: an unused special token
    gen_batch: int | None = None  # max_num_seqs while generating (default 256 on CUDA, 32 on CPU)
    gen_workers: int = 1  # engine processes generating at once (train/parallel_data.py)
    init_from: Path | None = None  # start from this drafter's weights and config (fine-tuning)
    max_prompt_len: int = 768
    eval_prompts: int = 16  # held out from the prompts, for the periodic tau evaluation
    eval_max_tokens: int = 128
    device: str = "auto"
    resume: bool = False
    seed: int = 0


def _device(name: str) -> torch.device:
    return EngineConfig(device=name).resolve_device()


def generate_stage(cfg: PipelineConfig, device: torch.device, prompts: list) -> Path:
    gen = cfg.generation or GenerationConfig(seed=cfg.seed)
    data_dir = cfg.data_dir or cfg.out / "data"
    if data_complete(data_dir, gen):
        log.info("training data already in %s", data_dir)
        return data_dir
    batch = cfg.gen_batch or (256 if device.type == "cuda" else 32)
    spec = GeneratorSpec(target=cfg.target, device=str(device), max_num_seqs=batch,
                         max_num_batched_tokens=8192 if device.type == "cuda" else 2048,
                         max_model_len=cfg.max_prompt_len + gen.response_len, seed=cfg.seed)
    if cfg.gen_workers > 1:
        spec.kv_cache_memory = kv_share(device, cfg.gen_workers)
        return generate_parallel(spec, prompts, gen, data_dir, cfg.gen_workers)
    engine = spec.engine()
    try:
        generate_data(engine, prompts, gen, data_dir)
    finally:
        engine.release()
    return data_dir


def _eval_memory_fraction(device: torch.device, kv_bytes: int) -> float:
    """gpu_memory_utilization that leaves the evaluation engine about `kv_bytes` of KV cache: the
    engine takes a share of the whole card, and training needs the rest."""
    free, total = torch.cuda.mem_get_info(device)
    return min(0.95, (total - free + kv_bytes + GIB) / total)


def drafter_config(cfg: PipelineConfig, target_dir: Path, target_cfg: ModelConfig, samples: list) -> dict[str, Any]:
    """The drafter's z-lab config: reused from out/config.json when resuming, taken from the
    --init-from drafter when fine-tuning one, else made fresh."""
    existing = cfg.out / "config.json"
    if cfg.resume and existing.is_file():
        return json.loads(existing.read_text())
    if cfg.init_from is not None:
        source = first_layers(init_config(cfg.init_from, target_cfg), cfg.num_layers)
        return as_dflash2(source, cfg.block_size, cfg.dflash2) if upgrades(cfg) else source
    if cfg.mask_token_id is not None:
        mask_id = cfg.mask_token_id
        if not 0 <= mask_id < target_cfg.vocab_size:
            raise ConfigError(f"--mask-token-id {mask_id} is outside the vocabulary (0..{target_cfg.vocab_size - 1})")
    else:
        tokenizer = load_tokenizer(target_dir, None, None)
        mask_id = pick_mask_token(tokenizer, token_counts(samples, target_cfg.vocab_size), target_cfg.vocab_size)
    layer_ids = parse_layer_ids(cfg.target_layer_ids, target_cfg.num_hidden_layers)
    return drafter_config_json(target_cfg, cfg.num_layers or 2, cfg.block_size, mask_id, layer_ids, dflash2=cfg.dflash2)


def init_config(init_from: Path, target_cfg: ModelConfig) -> dict[str, Any]:
    """The config of the drafter to fine-tune, checked against the target it will read."""
    path = init_from / "config.json"
    if not path.is_file():
        raise ConfigError(f"--init-from {init_from} has no config.json: pass a DFlash drafter directory")
    config_json = json.loads(path.read_text())
    try:
        DrafterConfig.from_dict(config_json).check_target(target_cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"--init-from {init_from}: not a DFlash drafter config ({exc})") from None
    return config_json


def first_layers(config_json: dict[str, Any], num_layers: int | None) -> dict[str, Any]:
    """The drafter to start from cut to its first `num_layers` layers (None: all of them)."""
    have = config_json["num_hidden_layers"]
    if num_layers is None or num_layers == have:
        return config_json
    if num_layers > have:
        raise ConfigError(f"--num-layers {num_layers}: the --init-from drafter has {have} layers; a drafter started "
                          f"from it keeps {have} or fewer (its first ones)")
    types = config_json.get("layer_types") or ["full_attention"] * have
    return {**config_json, "num_hidden_layers": num_layers, "layer_types": types[:num_layers]}


def _kept_layers(num_layers: int) -> Callable[[str], str | None]:
    """Checkpoint names of a drafter cut to its first layers: the later layers' tensors are not read."""
    def name(raw: str) -> str | None:
        plain = checkpoint_name(raw)
        parts = plain.split(".")
        return None if parts[0] == "layers" and int(parts[1]) >= num_layers else plain
    return name


def upgrades(cfg: PipelineConfig) -> bool:
    """--arch dflash2 from a DFlash 1 drafter: its shared weights start a DFlash 2 drafter."""
    if cfg.init_from is None or cfg.dflash2 is None:
        return False
    source = json.loads((cfg.init_from / "config.json").read_text())
    return "DFlash2DraftModel" not in source.get("architectures", [])


def run(cfg: PipelineConfig) -> dict[str, Any]:
    """The whole pipeline; returns (and writes to out/train_summary.json) what the model card says."""
    t0 = time.perf_counter()
    device = _device(cfg.device)
    cfg.out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_model_path(cfg.target)
    target_cfg = ModelConfig.from_dir(target_dir)
    train_prompts, heldout = split_heldout(load_prompts(cfg.prompts, cfg.seed), cfg.eval_prompts)
    gen = cfg.generation or GenerationConfig(seed=cfg.seed)
    cfg.generation = gen
    data_dir = generate_stage(cfg, device, train_prompts)
    t_data = time.perf_counter() - t0
    samples = load_samples(data_dir, gen.num_samples)

    config_json = drafter_config(cfg, target_dir, target_cfg, samples)
    dcfg = DrafterConfig.from_dict(config_json)
    block = dcfg.block_size
    longest = -(-max(len(s.ids) for s in samples) // 128) * 128
    drafter = build_training_drafter(dcfg, longest + block, device, cfg.seed)
    windows = [w for w in (dcfg.layer_mask_kind(i)[1] for i in range(len(dcfg.layer_types))) if w]
    if windows and min(windows) < longest + block:
        log.warning("the drafter's sliding window (%d) is shorter than the training sequences (%d tokens): "
                    "training attends over the whole context, serving over the window", min(windows), longest)
    if cfg.init_from is not None and not cfg.resume:
        load_weights(drafter, cfg.init_from, device, torch.float32, names=_kept_layers(dcfg.model.num_hidden_layers),
                     fresh=dflash2_only if upgrades(cfg) else None)
        if upgrades(cfg):
            identity_convolutions(drafter)
    save_drafter(drafter, config_json, cfg.out)  # the evaluation engine loads the drafter from here

    eval_len = cfg.max_prompt_len + cfg.eval_max_tokens + block
    kw: dict[str, Any] = {"kv_cache_memory": GIB // 4}
    if device.type == "cuda":
        kw = {"gpu_memory_utilization": _eval_memory_fraction(device, 2 * GIB)}
    engine = Engine(EngineConfig(
        model=str(target_dir), device=str(device), max_model_len=max(longest, eval_len),
        max_num_seqs=max(1, min(64, len(heldout))), seed=cfg.seed,
        speculative=SpeculativeConfig(model=str(cfg.out)), **kw))
    heldout_texts = [t for t in chat_texts(engine, [p.messages for p in heldout])
                     if len(engine.encode(t)) <= cfg.max_prompt_len]  # as the training prompts: no overflow
    if len(heldout_texts) < len(heldout):
        log.warning("skipped %d held-out prompts longer than --max-prompt-len %d", len(heldout) - len(heldout_texts),
                    cfg.max_prompt_len)
    evaluator = TauEvaluator(engine, heldout_texts, cfg.eval_max_tokens) if heldout_texts else None
    if not cfg.resume and cfg.init_from is None:
        copy_final_norm(drafter, engine.runner.target)
    train_cfg = cfg.training or TrainConfig(seed=cfg.seed)
    trainer = Trainer(train_cfg, drafter, engine.runner.target, samples, cfg.out, device, evaluator)
    result = trainer.train(resume=cfg.resume)
    save_drafter(drafter, config_json, cfg.out)
    engine.release()

    summary = _summary(cfg, target_dir, config_json, samples, result, device, t_data, time.perf_counter() - t0)
    (cfg.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_model_card(cfg.out, f"DFlash drafter for {target_dir.name}", card_sections(summary))
    return summary


def _summary(cfg: PipelineConfig, target_dir: Path, config_json: dict[str, Any], samples: list,
             result: TrainResult, device: torch.device, t_data: float, wall: float) -> dict[str, Any]:
    response_tokens = int(sum(int(s.mask.sum()) for s in samples))
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "target": target_dir.name,
        "drafter": {k: config_json.get(k) for k in ("architectures", "num_hidden_layers", "hidden_size",
                                                    "intermediate_size", "block_size")}
        | dict(config_json["dflash_config"]),
        "data": {"prompts": cfg.prompts, "samples": len(samples), "response_tokens": response_tokens,
                 **asdict(cfg.generation)},
        "training": {**asdict(cfg.training or TrainConfig(seed=cfg.seed)), "steps": result.steps,
                     "epochs_done": round(result.epochs_done, 2), "final_loss": round(result.loss, 4),
                     "final_tau_est": round(result.tau_est, 3), "wall_s": round(result.wall_s, 1)},
        "init_from": str(cfg.init_from) if cfg.init_from else None,
        "upgraded_from_dflash1": upgrades(cfg),
        "heldout_eval": result.last_eval,
        "device": dev,
        "data_wall_s": round(t_data, 1),
        "total_wall_s": round(wall, 1),
    }


def _later_passes(d: dict[str, Any]) -> str:
    sampled = f"at temperature {d['temperature']} (top-p {d['top_p']})"
    text = f"a {d['sampled_prefix']}-token lead-in sampled {sampled}, then greedy" if d.get("sampled_prefix", 0) > 0 \
        else f"sampled {sampled}"
    if d.get("self_prompts", 0) > 0:
        text += (f"; {d['self_prompts']:.0%} of them instead answer, greedily, a user message the target wrote "
                 "itself (sampled at temperature 0.8 from one of our openers, e.g. the start of a Python "
                 "function stub)")
    return text


def _labels(t: dict[str, Any]) -> str:
    if t.get("labels", "data") == "greedy":
        return "the target's greedy chain (argmax after each stored token, cut at the first disagreement)"
    return "the stored tokens"


def _init_from(summary: dict[str, Any]) -> str:
    src = summary.get("init_from")
    if not src:
        return ""
    if summary.get("upgraded_from_dflash1"):
        return (f"Starting from the DFlash 1 drafter in {src} (see its own card): its attention, MLP, norm and "
                "feature weights; the convolutions start as the identity and the selector fresh. ")
    return f"Starting from the weights of the drafter in {src} (see its own card): "


def _kind(m: dict[str, Any]) -> str:
    if "DFlash2DraftModel" not in (m.get("architectures") or []):
        return "DFlash"
    return (f"DFlash 2 ({m['conv_kernel_size']}-tap grouped dynamic convolutions, a candidate selector over the "
            f"top {m['selector_top_k']} tokens with rank-{m['selector_rank']} pairwise scores)")


def card_sections(summary: dict[str, Any]) -> dict[str, str]:
    """Model-card sections from a pipeline summary (callers may add their own evaluation)."""
    d, t, m = summary["data"], summary["training"], summary["drafter"]
    ev = summary.get("heldout_eval") or {}
    sections = {
        "Model": (f"A {m['num_hidden_layers']}-layer {_kind(m)} block-diffusion drafter (hidden {m['hidden_size']}, "
                  f"block size {m['block_size']}) for {summary['target']}. It reads target layers "
                  f"{m['target_layer_ids']}; its mask token is id {m['mask_token_id']}, an existing token the target "
                  "never writes in the training data. z-lab format: loads with `blockspec --draft DIR` and with "
                  "the `dflash` reference package."),
        "Data": (f"{d['samples']} responses ({d['response_tokens']} tokens) written by the target itself through "
                 f"blockspec's engine from the prompt set '{d['prompts']}' (our own code, step-by-step math, dialogue, "
                 f"prose and JSON prompts; no HumanEval task, none of the benchmark prompts): the first pass over the "
                 f"prompts greedy, later passes {_later_passes(d)}; responses up to {d['response_len']} tokens. "
                 f"Generation took {summary['data_wall_s']} s."),
        "Training": (_init_from(summary)
                     + f"{t['steps']} steps ({t['epochs_done']} epochs) of {t['batch_size']} sequences x "
                     f"{t['num_anchors']} random anchors, AdamW lr {t['lr']}, cosine with {t['warmup_ratio']:.0%} "
                     f"warm-up, grad clip {t['grad_clip']}, loss weights exp(-(k-1)/gamma), labels "
                     f"{_labels(t)}, on {summary['device']}; "
                     f"{t['wall_s']} s. Final loss {t['final_loss']}, batch tau estimate {t['final_tau_est']}."),
    }
    if ev:
        per = ", ".join(f"{a:.2f}" for a in ev.get("acceptance_per_position", []))
        sections["Held-out evaluation"] = (f"tau {ev['tau']:.3f} at k = {ev['k']}, temperature 0, on {ev['prompts']} "
                                           f"prompts held out of training. Acceptance by draft position: {per}.")
    return sections
