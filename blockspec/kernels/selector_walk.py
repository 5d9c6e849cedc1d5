"""DFlash 2's candidate-selector walk as one kernel: the slots of a block visited left to right, each scoring its
top-K candidates by their logit plus the low-rank pairwise term with the token chosen before it.

spec/dflash2.CandidateSelector.walk is the definition (and the CPU path): per slot two codebook lookups, a
product, a batched matmul, an add and an argmax (a softmax and a second argmax when sampling), so a 7-slot walk
is ~50-70 launches, each a few microseconds on a GPU, inside every drafter step. Here one program walks one
row's slots with the codebook rows gathered in registers, rounding as the definition does: the predecessor row
times the context and the pairwise sum in the activation dtype, the score as their sum in it. The greedy path
then equals the definition's except where two candidates' scores differ only in the last bit of the
definition's differently ordered matmul sum. Sampled rows draw from the q the kernel returns (the exponential
race over q / noise), so verification stays exact.
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, pdl

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _walk_kernel(UNARY, CAND, CTX, ANCHOR, PRED, SUCC, TEMP, NOISE, PATH, Q, P, K: tl.constexpr,
                     RANK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SAMPLING: tl.constexpr,
                     PDL: tl.constexpr):
        wait_for_inputs(PDL)
        dtype = UNARY.dtype.element_ty
        r = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < K
        rs = tl.arange(0, BLOCK_R)
        r_mask = rs < RANK
        pred = tl.load(ANCHOR + r).to(tl.int64)
        temp = 1.0
        greedy = True
        if SAMPLING:
            t = tl.load(TEMP + r).to(tl.float32)
            temp = tl.maximum(t, 1e-5)
            greedy = t <= 0.0
        for s in range(P):
            row = r * P + s
            cand = tl.load(CAND + row * K + ks, mask=k_mask, other=0).to(tl.int64)
            unary = tl.load(UNARY + row * K + ks, mask=k_mask, other=0.0)
            ctx = tl.load(CTX + row * RANK + rs, mask=r_mask, other=0.0)
            left = (tl.load(PRED + pred * RANK + rs, mask=r_mask, other=0.0).to(tl.float32)
                    * ctx.to(tl.float32)).to(dtype)
            succ = tl.load(SUCC + cand[:, None] * RANK + rs[None, :], mask=k_mask[:, None] & r_mask[None, :],
                           other=0.0)
            pair = tl.sum(succ.to(tl.float32) * left.to(tl.float32)[None, :], axis=1).to(dtype)
            scores = (unary.to(tl.float32) + pair.to(tl.float32)).to(dtype).to(tl.float32)
            scores = tl.where(k_mask, scores, float("-inf"))
            best = tl.argmax(scores, axis=0)
            if SAMPLING:
                z = scores / temp
                e = tl.where(k_mask, tl.exp(z - tl.max(z, axis=0)), 0.0)
                q = e / tl.sum(e, axis=0)
                tl.store(Q + row * K + ks, q, mask=k_mask)
                noise = tl.load(NOISE + row * K + ks, mask=k_mask, other=1.0)
                drawn = tl.argmax(tl.where(k_mask, q / noise, -1.0), axis=0)
                best = tl.where(greedy, best, drawn)
            pred = tl.sum(tl.where(ks == best, cand, 0), axis=0)
            tl.store(PATH + row, pred)
        release_dependents(PDL)


def selector_walk(unary: torch.Tensor, candidates: torch.Tensor, context: torch.Tensor, anchors: torch.Tensor,
                  predecessor_codebook: torch.Tensor, successor_codebook: torch.Tensor,
                  temperature: torch.Tensor | None = None, noise: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """unary [R, P, K] (the top-K logits), candidates [R, P, K] (their ids), context [R, P, rank] (the slots'
    projected hidden states), anchors [R], the [V, rank] codebooks; temperature [R] and noise [R, P, K] ~ Exp(1)
    when any row samples. Returns (path [R, P], q [R, P, K] float32 or None), as CandidateSelector.walk."""
    r, p, k = candidates.shape
    rank = context.shape[-1]
    path = torch.empty(r, p, dtype=candidates.dtype, device=candidates.device)
    sampling = temperature is not None
    q = torch.empty(r, p, k, dtype=torch.float32, device=unary.device) if sampling else None
    if r == 0 or p == 0:
        return path, q
    unary, candidates, context = unary.contiguous(), candidates.contiguous(), context.contiguous()
    on = pdl(unary)
    _walk_kernel[(r,)](
        unary, candidates, context, anchors.contiguous(), predecessor_codebook.contiguous(),
        successor_codebook.contiguous(), temperature if sampling else unary,
        noise.contiguous() if sampling else unary, path, q if sampling else unary, p, K=k, RANK=rank,
        BLOCK_K=triton.next_power_of_2(k), BLOCK_R=triton.next_power_of_2(rank), SAMPLING=sampling, PDL=on,
        num_warps=4 if k * rank >= 4096 else 1, launch_pdl=on)
    return path, q
