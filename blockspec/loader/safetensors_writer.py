"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once; a converted model is written
from a stream instead: the header is laid out from the known names and shapes, then each tensor's
bytes are appended as it arrives and dropped, so memory holds one tensor, not the model.
"""

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from blockspec.loader.errors import ModelLoadError

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


def write_safetensors(
    path: Path,
    specs: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``tensors`` (arriving in ``specs`` order, all of ``dtype``) to ``path``."""
    item_size = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, shape in specs:
        nbytes = item_size * math.prod(shape)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    expected = iter(specs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, tensor in tensors:
            want = next(expected, None)
            got = (name, tuple(tensor.shape))
            if want is None or (want[0], tuple(want[1])) != got or tensor.dtype != dtype:
                raise ModelLoadError(
                    f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the "
                    f"planned layout {want}: this is a blockspec bug, please report it"
                )
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(data.numpy().data)
        if next(expected, None) is not None:
            raise ModelLoadError(f"the tensor stream for {path} ended early: this is a blockspec bug, please report it")
