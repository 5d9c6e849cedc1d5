"""DFlash 2's two additions to the DFlash drafter: a dynamic convolution around every sublayer, a candidate selector.

Grouped dynamic causal convolution: around each attention and MLP sublayer, the block's rows are mixed
with the rows before them in the same block (conv_kernel_size taps; the taps are zero across the block
boundary, so the anchor row only sees itself). Each tap's weight is a learned per-channel base plus a
per-group offset predicted from the sublayer's (normed) input row, for the input side ("prepare") and
for the output side ("finish") alike.

Candidate selector: instead of an independent argmax per block slot, keep the top-K tokens of every
slot (K = selector_top_k) and walk the slots left to right from the verified anchor token, scoring each
candidate by its logit plus a low-rank pairwise term between the previous token and the candidate
(predecessor / successor codebooks, modulated by the slot's hidden state). Greedy takes the best
candidate at each slot; at temperature T > 0 the walk samples from softmax(score / T) over the K
candidates and returns those distributions as q, which the lossless verification uses. The walk runs on
the device in a fixed number of steps (no host reads), so it is captured with the drafter's CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.kernels._triton import use_triton
from blockspec.kernels.grouped_conv import grouped_conv_triton
from blockspec.kernels.selector_walk import selector_walk
from blockspec.kernels.skinny_linear import linear
from blockspec.models.layers.linear import Linear


def grouped_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                 block_index: torch.Tensor) -> torch.Tensor:
    """grouped_conv_ref as one kernel (kernels/grouped_conv.py) for the drafter's 2-D rows, else the reference."""
    if x.dim() == 2 and dynamic.dim() == 3 and use_triton(x) and x.is_contiguous() and dynamic.stride(-1) == 1:
        return grouped_conv_triton(x, dynamic, base, group_size, block_index)
    return grouped_conv_ref(x, dynamic, base, group_size, block_index)


def grouped_conv_ref(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                     block_index: torch.Tensor) -> torch.Tensor:
    """x [..., T, H]; dynamic [..., T, taps, G] per-group offsets; base [taps, H]; block_index [T] each row's
    index inside its block (rows of a block are contiguous). Row t mixes rows t - j of its own block."""
    *lead, t, h = x.shape
    groups = h // group_size
    xg = x.view(*lead, t, groups, group_size)
    out = torch.zeros_like(xg)
    for offset in range(base.shape[0]):
        if offset == 0:
            values = xg
        else:
            values = F.pad(xg[..., :-offset, :, :], (0, 0, 0, 0, offset, 0))
            values = values * (block_index >= offset).to(x.dtype)[:, None, None]
        out = out + base[offset].view(groups, group_size).to(x.dtype) * values
        out = torch.addcmul(out, dynamic[..., offset, :, None], values)
    return out.view_as(x)


class GroupedDynamicConv(nn.Module):
    """`layers.{i}.attention_conv` / `mlp_conv`: base_kernel [2, taps, H] (input and output side) and
    kernel_projection H -> 2 * taps * groups."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0  # the identity until weights load (random-weight benchmarks run it as is)
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, block_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input side: (convolved x, the output side's dynamic taps, predicted from x too)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        out = grouped_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block_index)
        return out, dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor, block_index: torch.Tensor) -> torch.Tensor:
        return grouped_conv(y, dynamic, self.base_kernel[1], self.group_size, block_index)


class CandidateSelector(nn.Module):
    """`candidate_selector.*`: hidden_projection H -> rank, predecessor/successor codebooks [V, rank]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = Linear(hidden_size, rank, bias=False)

    def pair_scores(self, context: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor
                    ) -> torch.Tensor:
        """The pairwise term [..., K]: context [..., rank] (projected hidden), predecessor [...] token ids,
        candidates [..., K] token ids."""
        return pair_scores(context, predecessor, candidates, self.predecessor_codebook.weight,
                           self.successor_codebook.weight)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
             temperature: torch.Tensor | None = None, noise: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [R, P, H], logits [R, P, V] of the P draft slots; anchors [R] the verified token before them.

        temperature [R] (0: greedy row) and noise [R, P, K] ~ Exp(1) make the walk sample where T > 0.
        Returns (path [R, P], candidates [R, P, K], q [R, P, K] or None when nothing samples).
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        context = linear(hidden.reshape(-1, hidden.shape[-1]), self.hidden_projection.weight)
        context = context.view(*hidden.shape[:-1], -1)
        walk = selector_walk if use_triton(hidden) else walk_slots  # kernels/selector_walk.py: one launch
        path, q = walk(unary, candidates, context, anchors, self.predecessor_codebook.weight,
                       self.successor_codebook.weight, temperature, noise)
        return path, candidates, q


def pair_scores(context: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor,
                predecessor_codebook: torch.Tensor, successor_codebook: torch.Tensor) -> torch.Tensor:
    """The pairwise term [..., K] of CandidateSelector (its codebooks [V, rank] given)."""
    left = F.embedding(predecessor, predecessor_codebook) * context
    return torch.matmul(F.embedding(candidates, successor_codebook), left[..., None])[..., 0]


def walk_slots(unary: torch.Tensor, candidates: torch.Tensor, context: torch.Tensor, anchors: torch.Tensor,
               predecessor_codebook: torch.Tensor, successor_codebook: torch.Tensor,
               temperature: torch.Tensor | None = None, noise: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The walk over the slots, given the top-K (unary, candidates [R, P, K]) and the projected context
    [R, P, rank]: (path [R, P], q [R, P, K] or None). The definition and the CPU path of
    kernels/selector_walk.selector_walk."""
    sampling = temperature is not None
    if sampling:
        temp = temperature.clamp(min=1e-5)[:, None].float()
        greedy = (temperature <= 0)[:, None]
    predecessor, path, qs = anchors, [], []
    for slot in range(candidates.shape[1]):
        scores = unary[:, slot] + pair_scores(context[:, slot], predecessor, candidates[:, slot],
                                              predecessor_codebook, successor_codebook)
        best = scores.argmax(-1)
        if sampling:
            q = (scores.float() / temp).softmax(-1)
            drawn = (q / noise[:, slot]).argmax(-1)  # exponential race: index j with probability q_j
            best = torch.where(greedy[:, 0], best, drawn)
            qs.append(q)
        predecessor = candidates[:, slot].gather(-1, best[:, None])[:, 0]
        path.append(predecessor)
    return torch.stack(path, dim=1), torch.stack(qs, dim=1) if sampling else None
