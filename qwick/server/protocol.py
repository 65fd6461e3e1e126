"""Request and response models of the HTTP API: OpenAI's field names, defaults and shapes, plus vLLM's
extra sampling fields.

Requests are validated strictly from the raw JSON body (`Model.model_validate_json`): no string-to-number
coercion, no NaN/Infinity, and fields nobody knows are rejected with 400 ("Unrecognized request argument
supplied: <name>", OpenAI's own wording) so a typo such as `max_token` never passes silently. Fields that
OpenAI defines and qwick does not implement are either accepted and ignored where they cannot change the
output (`user`, `store`, `metadata`, `service_tier`, ...) or rejected with 400 when set to anything but
their neutral value (`functions`, `suffix`, ...): see `serving_chat.py` and `serving_completions.py`. Tool
definitions are validated here (OpenAI's shape, unknown keys rejected); what they mean for the request is
decided in `serving_chat.py`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # OpenAI's bound on n
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_STOP = 16


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are supported, got {len(value)}")
        return value
    raise ValueError("stop must be a string or a list of strings")


def _check_logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    if value is None:
        return None
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0:
            raise ValueError(f"logit_bias token id must be non-negative, got {token}")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
    return value


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(RequestModel):
    """Fields shared by chat completions and completions."""

    model: str | None = None  # OpenAI requires it; qwick defaults to the served model
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # Accepted and ignored: they cannot change what is generated.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    # vLLM's structured-output extras (at most one of them, and not with a JSON response_format).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    _stop = field_validator("stop", mode="before")(_check_stop)
    _bias = field_validator("logit_bias")(_check_logit_bias)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value and min(value) < 0:
            raise ValueError("stop_token_ids must be non-negative")
        return value


# ---- chat completions -------------------------------------------------------------------------------

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCallParam(BaseModel):
    """A call the assistant made, as clients send it back: `arguments` is JSON text (OpenAI's shape); an
    object is accepted too."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    """A message of the conversation. Fields the SDK echoes back from a response (refusal, audio,
    reasoning_content, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None  # role "tool": the call this message answers

    @field_validator("role")
    @classmethod
    def _role(cls, role: str) -> str:
        if role == "function":
            raise ValueError("'function' messages are not supported (deprecated by OpenAI); use 'tool'")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"Invalid value: '{role}'. Supported values are: "
                "'system', 'developer', 'user', 'assistant' and 'tool'"
            )
        return role


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def _check_tool_choice(value: Any) -> Any:
    """`none`, `auto`, `required`, or `{"type": "function", "function": {"name": ...}}`."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
        and set(value) == {"type", "function"}
        and set(value["function"]) == {"name"}
    ):
        return value
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": "<a tool\'s name>"}}'
    )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # checked by _check_tool_choice
    parallel_tool_calls: bool | None = None  # false: at most one tool call
    response_format: dict[str, Any] | None = None  # json_object / json_schema (serving.py)
    # Accepted only at their neutral value (checked in serving_chat.py).
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    _tool_choice = field_validator("tool_choice", mode="before")(_check_tool_choice)


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None  # vLLM's and DeepSeek's field: the model's thinking, if split off

    @model_serializer(mode="wrap")
    def _drop_no_reasoning(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        return out


class ChatChoice(ResponseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop token id or string that ended it


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class Usage(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class Timing(ResponseModel):
    """qwick's extension: where this request's time went, and its token counts."""

    queue_ms: float | None = None  # arrival at the engine -> first scheduled
    prefill_ms: float | None = None  # first scheduled -> first token
    decode_ms: float | None = None  # first token -> finished
    e2e_ms: float | None = None  # arrival at the engine -> finished
    ttft_ms: float | None = None  # arrival -> first token
    tpot_ms: float | None = None  # decode_ms per output token after the first
    preprocess_ms: float | None = None  # HTTP request received -> arrival at the engine (template, tokenize)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | None = None
    qwick: Timing | None = None


def _drop_none(self: BaseModel, handler: Any) -> dict[str, Any]:
    return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None

    _serialize = model_serializer(mode="wrap")(_drop_none)


class DeltaToolCall(ResponseModel):
    """A streamed tool call: the first delta of a call has index, id, type and name (arguments ""), the
    next ones only index and argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    _serialize = model_serializer(mode="wrap")(_drop_none)


class DeltaMessage(ResponseModel):
    """A streamed chunk's delta: only the fields it carries (OpenAI's finish chunk has `"delta": {}`)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
    qwick: Timing | None = None


# ---- completions ------------------------------------------------------------------------------------


def _check_prompt(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return value
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in value
        ):
            return value
    if isinstance(value, list) and not value:
        raise ValueError("prompt must not be empty")
    raise ValueError(
        "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
    )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None  # as in chat (vLLM accepts it on completions too)

    _prompt = field_validator("prompt", mode="before")(_check_prompt)


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    qwick: Timing | None = None


# ---- models, tokenize, detokenize, generate ---------------------------------------------------------


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "qwick"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """Either `prompt` (text) or `messages` (a conversation, through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered into the prompt as /v1/chat/completions would
    return_token_strs: bool = False


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class GenerateSamplingParams(RequestModel):
    """`SamplingParams` fields, typed, for `/generate` (vLLM's names and defaults)."""

    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = Field(None, le=MAX_TOP_LOGPROBS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None

    _stop = field_validator("stop", mode="before")(_check_stop)
    _bias = field_validator("logit_bias")(_check_logit_bias)


class GenerateRequest(RequestModel):
    prompt: str | list[int]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    priority: int = 0

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        ):
            return value
        raise ValueError("prompt must be a string or a list of token ids")


class GenerateResponse(ResponseModel):
    text: list[str]
    finish_reason: list[str | None] | None = None
    qwick: Timing | None = None
