"""Structured outputs with xgrammar, vLLM's default grammar engine.

A request's constraint (``StructuredOutput``: JSON schema, JSON object, regex, choice, EBNF/Lark grammar
or xgrammar structural tag) is compiled once per distinct constraint, before the request is admitted
and off the engine thread (``GrammarCompiler.compile``, LRU-cached). Each sequence then owns a
``GrammarMatcher`` that the sampler asks for a token bitmask every step (``apply_grammar_bitmasks``, one
batched call) and that ``Scheduler.postprocess`` advances with the token it got. Compilation errors and
schema features xgrammar would silently ignore are refused with a 400 naming the request field, as vLLM
does (vllm/v1/structured_output/backend_xgrammar.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from backends.base import InvalidRequestError, StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

    from backends.native.sequence import Sequence
    from backends.tokenizer import Tokenizer

# String formats xgrammar's JSON schema converter knows (vLLM's STRING_SUPPORTED_FORMATS).
_STRING_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                   "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}


class GrammarCompiler:
    """Compiles ``StructuredOutput`` constraints for one tokenizer, keeping the last ``cache_size`` compiled
    grammars (LRU, keyed by the constraint: kind, spec text and whitespace mode). Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.compilations = 0  # grammars actually compiled (cache misses)

    def compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of ``so``; raises ``InvalidRequestError`` naming ``so.param`` if it is invalid."""
        key = (so.kind, so.spec, so.any_whitespace)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(so)
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its parser's message
            raise InvalidRequestError(f"Invalid {so.param}: {_first_line(exc)}", param=so.param) from exc
        with self._lock:
            self.compilations += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        c = self._compiler
        if so.kind == "json":
            schema = json.loads(so.spec)
            reason = unsupported_json_features(schema)
            if reason:
                raise InvalidRequestError(f"The JSON schema in {so.param} uses {reason}, which xgrammar cannot "
                                          "enforce.", param=so.param)
            return c.compile_json_schema(so.spec, any_whitespace=so.any_whitespace)
        if so.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=so.any_whitespace)
        if so.kind == "regex":
            if "\x00" in so.spec:
                raise InvalidRequestError(f"{so.param}: a regex must not contain a NUL character", param=so.param)
            return c.compile_regex(so.spec)
        if so.kind == "choice":
            return c.compile_grammar(choice_as_grammar(json.loads(so.spec)))
        if so.kind == "grammar":
            return c.compile_lark(so.spec) if grammar_is_likely_lark(so.spec) else c.compile_grammar(so.spec)
        if so.kind == "structural_tag":
            return c.compile_structural_tag(so.spec)
        raise InvalidRequestError(f"unknown structured output kind {so.kind!r}", param=so.param)


def new_matcher(grammar: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    """A fresh matcher (one per sequence) at the grammar's start."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammar)


def apply_grammar_bitmasks(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask, in place, the tokens each constrained row's grammar forbids next (-inf); other rows untouched.

    One bitmask for the batch, its constrained rows filled by their matchers, applied by one call of
    xgrammar's batched kernel (the CPU one, or the GPU one on the logits' device)."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None and not s.grammar.is_terminated()]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[1])
    for i in rows:
        seqs[i].grammar.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits


# ------------------------------------------------------------------------------ vLLM's helpers
def choice_as_grammar(choices: list[str]) -> str:
    """An EBNF grammar accepting exactly one of ``choices`` (vLLM's ``choice_as_grammar``)."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(escape(ch) for ch in c) + '"' for c in choices)


def grammar_is_likely_lark(grammar: str) -> bool:
    """A grammar with no ``::=`` rule is Lark, else EBNF (vLLM's ``grammar_is_likely_lark``)."""
    import re

    for line in grammar.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if line and "::=" in line:
            return False
    return True


def unsupported_json_features(schema: Any) -> str | None:
    """The first schema feature xgrammar would ignore or mis-enforce, or None (vLLM's
    ``has_xgrammar_unsupported_json_features``): refusing it beats returning output that breaks it."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(t for t in types or [] if isinstance(t, str))
    if types & {"integer", "number"} and "multipleOf" in schema:
        return "multipleOf"
    if "array" in types and (found := {"uniqueItems", "contains", "minContains", "maxContains"} & set(schema)):
        return sorted(found)[0]
    if "string" in types and "format" in schema and schema["format"] not in _STRING_FORMATS:
        return f"format {schema['format']!r}"
    if "string" in types and ("pattern" in schema or "format" in schema) and (
            "minLength" in schema or "maxLength" in schema):
        return "a pattern or format together with a length bound"
    if "object" in types and "propertyNames" in schema and (
            "properties" in schema or "patternProperties" in schema
            or schema.get("unevaluatedProperties", True) is not True
            or (isinstance(schema["propertyNames"], dict) and ("pattern" in schema["propertyNames"]
                                                               or "format" in schema["propertyNames"])
            and ("minLength" in schema["propertyNames"] or "maxLength" in schema["propertyNames"]))):
        return "propertyNames with properties or bounds"
    if "object" in types and isinstance(schema.get("patternProperties"), dict) and (
            "properties" in schema or len(schema["patternProperties"]) > 1):
        return "patternProperties with properties"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) >= 2:
        return "allOf with several branches"
    for value in schema.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and (reason := unsupported_json_features(item)):
                return reason
    return None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:123: " to its messages
    line = text.splitlines()[0] if text else type(exc).__name__
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
