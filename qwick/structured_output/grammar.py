"""From a request's `StructuredOutputsParams` to an xgrammar grammar: the cache key, validation, compilation.

xgrammar is imported only when a request asks for structured output, so everything else (and the GPU
machine, which has no xgrammar) runs without it.

JSON is generated compact (`", "` and `": "` separators, no free whitespace): with free whitespace small
models tend to emit newlines until max_tokens instead of closing the object (vLLM's known failure mode).

Two xgrammar 0.2 bugs are worked around here, both in length-bounded strings:

- a string with `minLength`/`maxLength` (and no `pattern`) is compiled to a character class that admits raw
  control characters, i.e. invalid JSON (mlc-ai/xgrammar#800), and UTF-8-encoded surrogates;
- in a `pattern` (the JSON-aware regex path), a character class whose code points need UTF-8 sequences of
  different lengths (`.`, `[^x]`) is matched byte by byte too loosely: it admits overlong sequences
  (E0 80..9F xx, F0 80..8F xx xx) and surrogates (ED A0..BF xx), each counted as one character. A sampled
  string then is not valid UTF-8 and decodes with U+FFFD replacements, up to three per counted character,
  past `maxLength`. A class of code points that all have one encoded length is matched exactly.

So such strings are rewritten to `pattern` `^C{min,max}$`, where C is one code point other than a surrogate,
as an alternation of classes of one encoded length each (`_CHAR`), without `"`, `\\` and control
characters, which `.` leaves out in this path too (an explicit class would let them through unescaped).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from qwick.sampling_params import StructuredOutputsParams

INSTALL_HINT = "structured output needs the xgrammar package: pip install xgrammar"
_JSON_OBJECT = '{"type": "object"}'  # json_object: any JSON object (properties unconstrained)
_MAX_ERROR_CHARS = 400
# xgrammar's errors start with a timestamp and a C++ source location, sometimes a failed check's text.
_ERROR_PREFIX = re.compile(
    r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?(Check failed: .*? is false:\s*)?"
)


@dataclass(frozen=True)
class GrammarSpec:
    """What gets compiled, as hashable text: the key of the compile cache.

    kind: "json" (a JSON Schema as JSON text), "regex" or "ebnf". `choice` becomes EBNF, `json_object`
    the schema `{"type": "object"}`, so equal constraints share one compiled grammar.
    """

    kind: str
    text: str


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The grammar a request's constraint stands for. ValueError if a schema is not JSON-serializable."""
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return GrammarSpec("json", params.json)  # xgrammar's validation says what is wrong
        if _bounded_strings_as_patterns(schema):
            schema = _rewrite_bounded_strings(schema)
        elif isinstance(params.json, str):
            return GrammarSpec("json", params.json)
        try:
            # Key order matters: xgrammar generates properties in the schema's order.
            return GrammarSpec("json", json.dumps(schema, ensure_ascii=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the JSON schema is not JSON-serializable: {exc}") from None
    if params.json_object:
        return GrammarSpec("json", _JSON_OBJECT)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        # JSON string literals are valid EBNF literals in xgrammar's dialect (same escapes).
        return GrammarSpec(
            "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        )
    assert params.grammar is not None  # StructuredOutputsParams guarantees exactly one field
    return GrammarSpec("ebnf", params.grammar)


# One code point, one class per UTF-8 length (1 to 4 bytes; see above): no surrogates, and in ASCII (as `.`
# in this path) no control characters, `"` or `\`, which the JSON-aware path would emit raw, unescaped, from
# an explicit class. xgrammar's regex has no escape past U+FFFF: the last class holds its ends literally.
_CHAR = (
    r"(?:[\u0020\u0021\u0023-\u005b\u005d-\u007f]|[\u0080-\u07ff]|[\u0800-\ud7ff]|[\ue000-\uffff]|"
    "[\U00010000-\U0010ffff])"
)

_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are data, not schemas


def _is_bounded_string(node: dict) -> bool:
    types = node.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    return (
        is_string
        and ("minLength" in node or "maxLength" in node)
        and "pattern" not in node
        and "format" not in node
    )


def _bounded_strings_as_patterns(node: Any) -> bool:
    """Whether the schema has a length-bounded string that `_rewrite_bounded_strings` would change."""
    if isinstance(node, dict):
        if _is_bounded_string(node):
            return True
        return any(_bounded_strings_as_patterns(v) for k, v in node.items() if k not in _DATA_KEYWORDS)
    if isinstance(node, list):
        return any(_bounded_strings_as_patterns(v) for v in node)
    return False


def _rewrite_bounded_strings(node: Any) -> Any:
    """A copy of the schema with `minLength`/`maxLength` strings expressed as a `pattern` (see above)."""
    if isinstance(node, list):
        return [_rewrite_bounded_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYWORDS else _rewrite_bounded_strings(v)) for k, v in node.items()}
    if _is_bounded_string(node):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return out


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return xgrammar


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its timestamp and C++ location, shortened."""
    lines = [_ERROR_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    text = " ".join(line for line in lines if line) or type(exc).__name__
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar"}


@lru_cache(maxsize=512)
def _check(spec: GrammarSpec) -> str | None:
    """Parse the spec into an xgrammar Grammar (no tokenizer needed, cheap); the error text or None."""
    xgr = import_xgrammar()
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        else:
            xgr.Grammar.from_ebnf(spec.text)
    except Exception as exc:  # xgrammar raises RuntimeError (and a few others) for bad input
        return f"invalid {_KIND_NAMES[spec.kind]}: {clean_error(exc)}"
    return None


def validate_structured_outputs(params: StructuredOutputsParams) -> GrammarSpec:
    """Check a constraint before it reaches the engine (cached per spec). ValueError says what is wrong."""
    spec = grammar_spec(params)
    error = _check(spec)
    if error is not None:
        raise ValueError(error)
    return spec


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """Compile with a tokenizer-bound `xgrammar.GrammarCompiler` (which also caches by spec)."""
    if spec.kind == "json":
        return compiler.compile_json_schema(spec.text, any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    return compiler.compile_grammar(spec.text)
