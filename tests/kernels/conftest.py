"""Kernel tests run Triton's interpreter on CPU (TRITON_INTERPRET=1) where no GPU is present."""

from __future__ import annotations

import pytest

from blockspec.kernels._triton import INTERPRET


@pytest.fixture(autouse=True, scope="session")
def interpreter_scalar_loop_bounds():
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds with
    int(array), which NumPy 2.4 refuses for arrays that are not 0-d: kernels whose loop bounds are loaded
    values (paged attention's key range) then fail only in the interpreter. Give its tensors an __index__
    that takes the one element."""
    if not INTERPRET:
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    yield
    interpreter._patch_lang_tensor = original
