"""Device presets for `blockspec plan`: how much memory CUDA reports and the peak memory bandwidth.

Memory is what `torch.cuda.mem_get_info` reports as total (unified-memory boxes share it with the
OS). Bandwidth is the spec-sheet peak; a measured copy usually reaches 85-90% of it (an H200 copies
at about 4.25 TB/s of its 4.8), so treat rooflines computed from it as upper bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class DevicePreset:
    name: str
    description: str
    memory_bytes: int
    bandwidth_gbs: float  # 1e9 bytes per second
    unified: bool  # memory shared with the CPU and the OS


PRESETS: dict[str, DevicePreset] = {
    "thor": DevicePreset("thor", "NVIDIA Jetson AGX Thor (128 GB LPDDR5X, unified)", int(122.8 * GIB), 273.0, True),
    "spark": DevicePreset("spark", "NVIDIA DGX Spark GB10 (128 GB LPDDR5X, unified)", int(119.7 * GIB), 273.0, True),
    "h100": DevicePreset("h100", "NVIDIA H100 SXM 80 GB HBM3", int(79.2 * GIB), 3350.0, False),
    "h200": DevicePreset("h200", "NVIDIA H200 141 GB HBM3e", int(139.8 * GIB), 4800.0, False),
    "rtx5090": DevicePreset("rtx5090", "NVIDIA GeForce RTX 5090 32 GB GDDR7", int(31.4 * GIB), 1792.0, False),
}
