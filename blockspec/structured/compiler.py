"""Specialising structured-output grammars to one model's vocabulary, once per distinct spec.

The vocabulary table (token strings, stop tokens) is built once per engine; each distinct spec is
compiled once (tens of milliseconds for a large vocabulary) and kept in a small LRU cache, so agents
that send the same schema on every request pay for it only on the first.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import xgrammar as xgr

from blockspec.structured.grammar import build_grammar, spec_key
from blockspec.structured.matcher import GrammarMatcher
from blockspec.structured.spec import StructuredSpec


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], cache_size: int = 128) -> None:
        """vocab_size: the model's logits width (the tokenizer may have fewer tokens); stop_ids: the
        tokens that end a generation, allowed exactly where the grammar is complete."""
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of spec (RequestError naming the problem if spec is invalid)."""
        key = spec_key(spec)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compiler.compile_grammar(build_grammar(spec))
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return compiled

    def matcher(self, spec: StructuredSpec) -> GrammarMatcher:
        """A fresh matcher for one sequence, at the start of the grammar."""
        return GrammarMatcher(self.compile(spec), self.vocab_size)
