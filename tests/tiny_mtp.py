"""A multi-token-prediction head for the tiny hybrid checkpoints, and a hand-written reference of it.

transformers has no MTP module for Qwen3-Next / Qwen3.5 (it skips the mtp.* weights), so the reference
is assembled from transformers' own pieces the way vLLM's qwen3_next_mtp.py and qwen3_5_mtp.py build the
head: zero-centred pre-norms on the token embedding and on the hidden state, fc over their concatenation,
one full-attention decoder layer of the family, the final norm; the target's embedding and LM head. It
recomputes every position on every call (no cache): the plainest statement of what the head computes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn


def _pieces(family: str):
    if family == "qwen3_next":
        m = transformers.models.qwen3_next.modeling_qwen3_next
        return m.Qwen3NextRMSNorm, m.Qwen3NextDecoderLayer, m.Qwen3NextRotaryEmbedding
    m = transformers.models.qwen3_5.modeling_qwen3_5
    return m.Qwen3_5RMSNorm, m.Qwen3_5DecoderLayer, m.Qwen3_5TextRotaryEmbedding


def text_config(model_dir: Path):
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    return getattr(cfg, "text_config", cfg)


class ReferenceMTP(nn.Module):
    def __init__(self, cfg, family: str) -> None:
        super().__init__()
        norm, layer, rotary = _pieces(family)
        cfg = copy.deepcopy(cfg)
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        h = cfg.hidden_size
        self.family = family
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([layer(cfg, 0)])
        self.norm = norm(h, eps=cfg.rms_norm_eps)
        self.rotary = rotary(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds / hidden [1, T, H] at positions 0..T-1 -> the head's output [1, T, H] (causal)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(x.shape[1])[None]
        if self.family == "qwen3_5":  # M-RoPE: text tokens have equal t/h/w positions
            positions = positions[None].expand(3, 1, -1)
        x = self.layers[0](x, position_embeddings=self.rotary(x, positions))
        return self.norm(x)


def _checkpoint_tensors(module: ReferenceMTP, prefix: str) -> dict[str, torch.Tensor]:
    """The head's state dict under checkpoint names: fused experts split into per-expert projections."""
    out = {}
    for name, tensor in module.state_dict().items():
        if name.startswith("rotary."):
            continue
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{base}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{base}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e, w in enumerate(tensor):
                out[f"{prefix}{base}{e}.down_proj.weight"] = w.contiguous()
        else:
            out[prefix + name] = tensor.contiguous()
    return out


def add_mtp_head(model_dir: Path, family: str, prefix: str = "mtp.", seed: int = 7) -> ReferenceMTP:
    """Give a tiny hybrid checkpoint a random MTP head under `prefix`; returns the reference holding it."""
    cfg = text_config(model_dir)
    torch.manual_seed(seed)
    head = ReferenceMTP(cfg, family).float()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:  # zero-centred: scale 1 + weight
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors.update(_checkpoint_tensors(head, prefix))
    save_file(tensors, path, metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    text["mtp_num_hidden_layers" if family == "qwen3_5" else "num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return head.eval()


def target_hidden(hf: nn.Module, ids: list[int]) -> torch.Tensor:
    """The target's final-normed hidden states [1, T, H] over ids."""
    base = getattr(hf.model, "language_model", hf.model)
    return base(input_ids=torch.tensor([ids])).last_hidden_state


@torch.no_grad()
def reference_drafts(hf: nn.Module, head: ReferenceMTP, ids: list[int], n: int) -> list[int]:
    """n greedy MTP drafts after ids (the last one the anchor, not yet run through the target): position p
    pairs token x_{p+1} with h_p; drafts feed the head's own output and their token to the next position."""
    hidden = target_hidden(hf, ids[:-1])
    embed = hf.get_input_embeddings()
    embeds = embed(torch.tensor([ids[1:]]))
    drafts = []
    for _ in range(n):
        out = head(embeds, hidden)
        token = int(hf.lm_head(out[0, -1]).argmax())
        drafts.append(token)
        embeds = torch.cat([embeds, embed(torch.tensor([[token]]))], dim=1)
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
    return drafts
