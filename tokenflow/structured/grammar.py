"""A request's output constraint as an llguidance matcher, compiled once per distinct constraint.

Why llguidance: a well-kept Rust library (vLLM's `guidance` backend) that takes JSON schemas, regexes
and Lark grammars, computes a step's token mask in well under a millisecond, bounds the work of every
step (`LLParserLimits`), and needs nothing beyond its wheel. Compiling a grammar builds its lexer: a
prototype matcher per constraint is kept in an LRU and each request gets a cheap deep copy.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from cachetools import LRUCache

from tokenflow.errors import InvalidRequest
from tokenflow.params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

__all__ = ("GrammarCompiler", "constraint_field", "grammar_of")

log = logging.getLogger("tokenflow")


# JSON is written with one space after ',' and ':' and no other whitespace: llguidance's default allows any
# run of whitespace, and small models then emit whitespace until max_tokens (the output never closes).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def constraint_field(params: SamplingParams) -> str | None:
    """The name of the request's constraint keyword, or None when its output is free text."""
    for name in ("json_schema", "regex", "choice", "grammar"):
        if getattr(params, name) is not None:
            return name
    return "json_object" if params.json_object else None


def grammar_of(params: SamplingParams) -> str | None:
    """The llguidance grammar (its JSON form) of the request's constraint, or None."""
    from llguidance import LLMatcher

    field = constraint_field(params)
    if field is None:
        return None
    try:
        if field == "json_schema":  # JSON text parsed first: a schema and its text share one grammar
            schema = json.loads(params.json_schema) if isinstance(params.json_schema, str) else params.json_schema
            if not isinstance(schema, dict):
                raise InvalidRequest("`json_schema` must be a JSON object", field=field)
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)  # type: ignore[arg-type]
        if field == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)  # type: ignore[arg-type]
        if field == "regex":
            return LLMatcher.grammar_from_regex(params.regex)  # type: ignore[arg-type]
        if field == "choice":
            # One terminal, the alternation of the strings as Lark literals (JSON escapes): the lexer matches
            # it as one automaton. As alternatives of a rule, each string is a parser item, and llguidance
            # gives up past 2,000 items in a row, which left 2,000 choices unenforced mid-answer.
            alternatives = " | ".join(json.dumps(c) for c in params.choice or ())
            return LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")
        return LLMatcher.grammar_from_lark(params.grammar)  # type: ignore[arg-type]
    except (ValueError, TypeError, RecursionError) as exc:  # not a JSON object, not JSON, nested too deep
        raise InvalidRequest(f"`{field}` is not valid: {exc}", field=field) from None


class GrammarCompiler:
    """Matchers for requests' constraints over one tokenizer. Thread-safe: compile in a worker thread
    (llguidance drops the GIL while it builds a lexer)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._cache: LRUCache[str, LLMatcher] = LRUCache(maxsize=cache_size)
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Lock] = {}
        self.num_compiled = 0
        self.num_cache_hits = 0

    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (about a second for a 50k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                log.info("building the structured-output tokenizer (%d tokens)", self.vocab_size)
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._tokenizer

    def matcher(self, params: SamplingParams) -> LLMatcher | None:
        """A fresh matcher for the request's constraint (None without one); `InvalidRequest` naming the
        field when the schema, regex or grammar does not compile or exceeds the parser's limits."""
        grammar = grammar_of(params)
        if grammar is None:
            return None
        with self._lock:
            gate = self._gates.setdefault(grammar, threading.Lock())
        with gate:  # one compile per grammar: concurrent first requests wait for it instead of repeating it
            try:
                with self._lock:
                    prototype = self._cache.get(grammar)
                    if prototype is not None:
                        self.num_cache_hits += 1
                        return prototype.deep_copy()
                prototype = self._compile(grammar, params)
                with self._lock:
                    self._cache[grammar] = prototype
                    self.num_compiled += 1
                return prototype.deep_copy()
            finally:
                with self._lock:
                    self._gates.pop(grammar, None)

    def _compile(self, grammar: str, params: SamplingParams) -> LLMatcher:
        from llguidance import LLMatcher, LLParserLimits

        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0, limits=LLParserLimits(verbose_errors=False))
        if matcher.is_error():
            field = constraint_field(params)
            raise InvalidRequest(f"`{field}` does not compile: {matcher.get_error()}", field=field)
        return matcher
