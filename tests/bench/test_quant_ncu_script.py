"""bench/quant_ncu.py's reading of Nsight Compute's raw CSV (the GPU parts run on the device only)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import quant_ncu  # noqa: E402

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
COLUMNS = ["ID", "Kernel Name", "gpu__time_duration.sum", "launch__grid_size", "launch__registers_per_thread",
           "sm__warps_active.avg.pct_of_peak_sustained_active", STALL.format("long_scoreboard"),
           STALL.format("short_scoreboard"), STALL.format("selected"), STALL.format("wait"), STALL.format("barrier")]


def _csv(rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return ",".join(f'"{c}"' for c in cells)
    units = ["", "", "nsecond", "", "register/thread", "%", "inst", "inst", "inst", "inst", "inst"]
    return "\n".join(["==PROF== Connected to process 1", line(COLUMNS), line(units)] + [line(r) for r in rows])


def test_parse_picks_the_counters_and_ranks_the_stalls(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text(_csv([["0", "_quant_linear_kernel", "10,080", "384", "64", "17.53", "1.46", "1.08", "1", "0.65",
                           "0.59"],
                          ["1", "_wide_kernel", "26500", "1536", "71", "33.14", "4.87", "0.16", "1", "1.55", ""]]))
    first, second = quant_ncu.parse(str(path))
    assert first["kernel"] == "_quant_linear_kernel" and first["us"] == "10.08" and first["grid"] == "384"
    assert first["regs"] == "64" and first["occ%"] == "17.53"
    assert first["stalls"] == "long_scoreboard 1.46, short_scoreboard 1.08, selected 1.00, wait 0.65"  # top 4
    assert second["us"] == "26.50" and second["stalls"].startswith("long_scoreboard 4.87, wait 1.55")
    assert "barrier" not in second["stalls"]  # an empty counter is left out
