"""Which grammar engine enforces structured outputs (kept free of its import, for the command line)."""

from __future__ import annotations

BACKEND = "xgrammar"  # chosen by measurement: bench/grammar_mask.py, bench/results/grammar_mask_cpu.json
ACCEPTED = ("auto", BACKEND)


def backend_problem(name: object) -> str | None:
    """Why `name` cannot be the structured-outputs backend, or None when it can."""
    if name in ACCEPTED:
        return None
    return f"structured-outputs backend {name!r} is not available: blockspec uses {BACKEND} (pass {BACKEND} or auto)"
