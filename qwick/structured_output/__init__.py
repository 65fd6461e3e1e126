"""Constrained decoding (structured output) with xgrammar: JSON Schema, JSON object, regex, choice, EBNF.

The pieces: `grammar` (a request's constraint -> a cacheable spec, validation, compilation), `manager`
(the compile cache off the engine loop, per-request matchers), and two hooks elsewhere: the sampler
applies each constrained row's token bitmask to its logits, and the scheduler advances the row's matcher
with the sampled token (a terminated grammar finishes the request with "stop").

Nothing here imports xgrammar or torch until a request asks for structured output.
"""

from qwick.structured_output.grammar import GrammarSpec, grammar_spec, validate_structured_outputs
from qwick.structured_output.manager import RequestGrammar, StructuredOutputManager

__all__ = [
    "GrammarSpec",
    "RequestGrammar",
    "StructuredOutputManager",
    "grammar_spec",
    "validate_structured_outputs",
]
