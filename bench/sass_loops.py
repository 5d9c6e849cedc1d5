"""The instruction mix of a Triton kernel's loops in sm_90 SASS, on a machine without a GPU: how many instructions
a kernel issues for the bytes each iteration loads (issue 14: the 4-bit GEMVs are instruction-bound, NOTES
sessions 29 and 31). Cases are bench/compile_sm90.py's, picked by a substring of their labels:

    PYTHONPATH=/tmp/t36site:. python bench/sass_loops.py "quant_gemv rows K=4096 TWO=True HAS_RES=True"

Prints, per case, each backward branch's loop: its static instruction count by opcode, its loads by width
(LDG from global memory, LDS from shared memory) and the order of its loads, barriers and mmas (`order`).
Triton's bundled cuobjdump disassembles the cubin.

`--against REV` compares instead: each picked case compiled from this tree and from REV's blockspec/ (under this
tree's bench/, so the cases are the same), a line each with the instruction count, the largest loop and the
registers of both, and whether the SASS is identical. That is how session 35 found the streamed GEMVs' byte
repacking and checked that its fix left every other kernel as it was, with no GPU (bench/NOTES.md).

    PYTHONPATH=/tmp/t36site:. python bench/sass_loops.py --against HEAD~1 "quant_gemv stream"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compile_sm90 as cs  # noqa: E402

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_PREDICATE = re.compile(r"^@!?U?P[T\d]+\s+")


def cubin(fn, types: dict[str, str], consts: dict, opts: dict) -> bytes:
    """The case's cubin, as compile_sm90.compile_case builds it."""
    return cs.build(fn, types, consts, opts.get("div16", ()), opts.get("num_warps", 4),
                    opts.get("num_stages", 3)).asm["cubin"]


def instructions(binary: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of a cubin."""
    text = cs.cuobjdump(binary, "-sass")
    if text is None:
        raise SystemExit("this Triton bundles no cuobjdump")
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_LINE.match, text.splitlines()) if m]


def sass(fn, types: dict[str, str], consts: dict, opts: dict) -> list[tuple[int, str]]:
    """(address, instruction) of the case's cubin."""
    return instructions(cubin(fn, types, consts, opts))


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


def order(body: list[str]) -> str:
    """A loop's memory and mma instructions in issue order, a letter each: L a global load, S a shared-memory load
    or barrier, M an mma. Where a step's loads sit against its mmas is what hides their latency (session 36: the
    streamed down projection's next-step loads moved from the loop's top to its middle and it lost 12%, with fewer
    instructions), and an S in a GEMV loop is a barrier or a trip through shared memory a step."""
    def letter(op: str) -> str:
        return "L" if op.startswith("LDG") else "S" if op.startswith(("LDS", "BAR")) else \
            "M" if op.startswith("HMMA") else ""
    return "".join(letter(opcode(t)) for t in body)


def picked(picks: list[str]) -> list[tuple[str, tuple, dict]]:
    return [case for case in cs.cases() if any(p in case[0] for p in picks)]


def summary(fn, types: dict[str, str], consts: dict, opts: dict) -> dict:
    """What --against compares of one case: instructions, loop sizes, registers and a hash of the SASS text."""
    binary = cubin(fn, types, consts, opts)
    code = instructions(binary)
    usage = cs.resources(binary)
    return {"instructions": len(code), "loops": [len(body) for body in loops(code)],
            "registers": usage[0] if usage else None, "stack": usage[1] if usage else None,
            "sass": hashlib.sha256("\n".join(ins for _, ins in code).encode()).hexdigest()[:16]}


def summaries(picks: list[str]) -> dict[str, dict]:
    return {label: summary(fn, types, consts, opts) for label, (fn, types, consts), opts in picked(picks)}


def against(rev: str, picks: list[str]) -> dict[str, dict]:
    """The picked cases compiled from REV's blockspec/ under this tree's bench/ (in a process of its own)."""
    from ab_engine import export_tree

    with tempfile.TemporaryDirectory(prefix="sass_rev_") as tmp:
        export_tree(rev, Path(tmp))
        shutil.rmtree(Path(tmp) / "bench")
        shutil.copytree(Path(__file__).resolve().parent, Path(tmp) / "bench",
                        ignore=shutil.ignore_patterns("results", "__pycache__"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, str(Path(tmp) / "bench" / "sass_loops.py"), "--json", *picks],
                              cwd=tmp, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"compiling at {rev} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout)


def compare(here: dict[str, dict], there: dict[str, dict], rev: str) -> str:
    def loop(s: dict) -> int:
        return max(s["loops"], default=0)

    lines = [f"{'case':<100} instructions {rev} -> here, largest loop, registers"]
    for label, new in here.items():
        old = there.get(label)
        if old is None:
            lines.append(f"{label[:100]:<100} only here")
            continue
        same = "identical SASS" if old["sass"] == new["sass"] else \
            f"{old['instructions']} -> {new['instructions']}, loop {loop(old)} -> {loop(new)}, " \
            f"registers {old['registers']} -> {new['registers']}"
        lines.append(f"{label[:100]:<100} {same}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("picks", nargs="*", help="substrings of bench/compile_sm90.py's case labels")
    ap.add_argument("--against", metavar="REV", help="compare each case with its SASS at REV")
    ap.add_argument("--json", action="store_true", help="the --against summaries of this tree as JSON")
    args = ap.parse_args(argv)
    if not args.picks:
        print(__doc__)
        return 2
    if args.json:
        print(json.dumps(summaries(args.picks)))
        return 0
    if args.against:
        print(compare(summaries(args.picks), against(args.against, args.picks), args.against))
        return 0
    for label, (fn, types, consts), opts in picked(args.picks):
        code = sass(fn, types, consts, opts)
        print(f"{label}: {len(code)} instructions")
        for body in loops(code):
            ops = Counter(opcode(t).split(".")[0] for t in body)
            loads = Counter(opcode(t) for t in body if opcode(t).startswith(("LDG", "LDS", "LDSM")))
            print(f"  loop of {len(body)}: {dict(ops.most_common(12))}\n    loads {dict(loads)}\n"
                  f"    order {order(body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
