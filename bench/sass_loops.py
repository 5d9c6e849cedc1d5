"""The instruction mix of a Triton kernel's loops in sm_90 SASS, on a machine without a GPU: how many instructions
a kernel issues for the bytes each iteration loads (issue 14: the 4-bit GEMVs are instruction-bound, NOTES
sessions 29 and 31). Cases are bench/compile_sm90.py's, picked by a substring of their labels:

    PYTHONPATH=/tmp/t36site:. python bench/sass_loops.py "quant_gemv rows K=4096 TWO=True HAS_RES=True"

Prints, per case, each backward branch's loop: its static instruction count by opcode and its loads by width
(LDG from global memory, LDS from shared memory). Triton's bundled cuobjdump disassembles the cubin.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compile_sm90 as cs  # noqa: E402

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_PREDICATE = re.compile(r"^@!?U?P[T\d]+\s+")


def sass(fn, types: dict[str, str], consts: dict, opts: dict) -> list[tuple[int, str]]:
    """(address, instruction) of the case's cubin, as compile_sm90.compile_case builds it."""
    kernel = cs.build(fn, types, consts, opts.get("div16", ()), opts.get("num_warps", 4), opts.get("num_stages", 3))
    text = cs.cuobjdump(kernel.asm["cubin"], "-sass")
    if text is None:
        raise SystemExit("this Triton bundles no cuobjdump")
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_LINE.match, text.splitlines()) if m]


def loops(code: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions from each backward branch's target up to the branch."""
    where = {addr: i for i, (addr, _) in enumerate(code)}
    out = []
    for i, (addr, ins) in enumerate(code):
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in where:
            out.append([t for _, t in code[where[int(m.group(1), 16)]:i + 1]])
    return out


def opcode(ins: str) -> str:
    return _PREDICATE.sub("", ins).split()[0]


def main() -> int:
    picks = sys.argv[1:]
    if not picks:
        print(__doc__)
        return 2
    for label, (fn, types, consts), opts in cs.cases():
        if not any(p in label for p in picks):
            continue
        code = sass(fn, types, consts, opts)
        print(f"{label}: {len(code)} instructions")
        for body in loops(code):
            ops = Counter(opcode(t).split(".")[0] for t in body)
            loads = Counter(opcode(t) for t in body if opcode(t).startswith(("LDG", "LDS", "LDSM")))
            print(f"  loop of {len(body)}: {dict(ops.most_common(12))}\n    loads {dict(loads)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
