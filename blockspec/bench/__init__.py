"""Client-side measurement: `blockspec bench`, `blockspec tune`, `blockspec plan`.

bench and tune talk to any OpenAI-compatible server (tune can also run the engine in-process);
plan reads config files only. The CLI registers all three through `add_bench_parsers`.
"""

from __future__ import annotations

import argparse


def add_bench_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add the bench, tune and plan subcommands to blockspec's CLI."""
    from blockspec.bench.bench_cmd import add_bench_parser
    from blockspec.bench.plan_cmd import add_plan_parser
    from blockspec.bench.tune import add_tune_parser

    add_bench_parser(subparsers)
    add_tune_parser(subparsers)
    add_plan_parser(subparsers)
