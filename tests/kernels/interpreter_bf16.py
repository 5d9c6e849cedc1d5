"""Triton's interpreter and bf16: make a CPU run under TRITON_INTERPRET=1 round and multiply bf16 as the GPU does."""

from __future__ import annotations

import torch


def interpreter_like_gpu(monkeypatch) -> None:
    """Triton 3.6's interpreter keeps bf16 as raw uint16 bits: its float32 -> bf16 cast truncates (the GPU rounds
    to nearest even) and its tl.dot multiplies the bit patterns as integers. Make both behave as on the GPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def to_bf16_bits(data: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
        return t.view(torch.int16).numpy().view(np.uint16)

    def from_bf16_bits(data: np.ndarray) -> np.ndarray:
        return (data.astype(np.uint32) << 16).view(np.float32)

    def fix_cast(orig):
        def cast(self, src, dst_type, *args):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return TensorHandle(to_bf16_bits(src.data), tl.bfloat16)
            return orig(self, src, dst_type, *args)
        return cast

    orig_dot = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 and b.dtype.scalar == tl.bfloat16:
            a, b = TensorHandle(from_bf16_bits(a.data), tl.float32), TensorHandle(from_bf16_bits(b.data), tl.float32)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(InterpreterBuilder, "cast_impl", fix_cast(InterpreterBuilder.cast_impl))
    monkeypatch.setattr(InterpreterBuilder, "create_fp_to_fp", fix_cast(InterpreterBuilder.create_fp_to_fp))
    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)
