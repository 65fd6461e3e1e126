"""Per-request sampling settings, with vLLM's field names and validation rules.

Torch-free: the scheduler and the API process import it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import IntEnum

_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """How `LLM.stream` / the server report progress: the whole text so far, or only what is new."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `StructuredOutputsParams`): exactly one of the fields is set.

    `json` is a JSON Schema (dict or JSON text); `json_object` asks for any JSON object; `regex`, `choice`
    (one of the strings) and `grammar` (EBNF, xgrammar's dialect) constrain the text directly.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) or 'none'}."
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of strings.")


@dataclass
class SamplingParams:
    """What to generate and how. Field names and defaults follow vLLM's `SamplingParams`."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine from the model's generation config / tokenizer, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            raise bad(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise bad(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            raise bad("stop cannot contain an empty string.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}.")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    raise bad(f"logit_bias token id must be non-negative, got {tok}.")
                if not -100.0 <= bias <= 100.0:
                    raise bad(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def update_from_generation_config(self, eos_token_ids: set[int]) -> None:
        """Add the model's end-of-sequence ids to the stop set (unless `ignore_eos`)."""
        if not self.ignore_eos:
            self.all_stop_token_ids |= set(eos_token_ids)
