"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's extensions.

Requests ignore fields they do not know, as vLLM does, so any OpenAI client works unchanged.
Value ranges are checked by SamplingParams.validate and the serving modules (one place, one message
per field); the schemas fix types and state those ranges (`_stated`), so generated clients and
fuzzers send what the server takes (tests/server/test_server_openapi.py keeps the two in step).
Streaming chunks are built as plain dicts in the serving modules (their keys must be present or
absent exactly as clients expect); the response models here document them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _stated(default: Any = None, **constraints: Any) -> Any:
    """A field whose JSON-schema constraints (minimum, maximum, enum...) document what the server
    enforces with its own messages: they appear in /openapi.json, pydantic does not check them."""
    return Field(default, json_schema_extra=constraints)


SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64
ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Request):
    """OpenAI's response_format.json_schema: the schema under `schema`, with a name for the client's records."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (or its text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="EBNF (root ::= ...) or Lark (start: ...)")
    json_object: bool | None = None
    disable_fallback: bool | None = Field(None, description="blockspec has one grammar engine and never falls back")
    disable_any_whitespace: bool | None = Field(None, description="not supported (true is refused)")
    disable_additional_properties: bool | None = Field(None, description="not supported (true is refused)")
    whitespace_pattern: str | None = Field(None, description="not supported (refused)")
    structural_tag: str | None = Field(None, description="not supported (refused)")


class ChatMessage(_Request):
    role: str = _stated(..., enum=list(ROLES))
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # every field reaches the chat template, as in vLLM

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None  # the served names are listed as an enum in /openapi.json (app.py)
    max_tokens: int | None = _stated(minimum=1)
    temperature: float | None = _stated(minimum=0)
    top_p: float | None = _stated(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _stated(minimum=-1)
    min_p: float | None = _stated(minimum=0, maximum=1)
    seed: int | None = _stated(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = _stated(1, minimum=1, maximum=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = _stated(minimum=-2, maximum=2)
    frequency_penalty: float | None = _stated(minimum=-2, maximum=2)
    repetition_penalty: float | None = _stated(exclusiveMinimum=0)
    ignore_eos: bool | None = None
    min_tokens: int | None = _stated(minimum=0)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = _stated(maxProperties=0, description="not supported (must be empty)")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="older vLLM name of structured_outputs.json")
    guided_regex: str | None = Field(None, description="older vLLM name of structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="older vLLM name of structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="older vLLM name of structured_outputs.grammar")
    guided_decoding_backend: str | None = Field(None, description="xgrammar or auto (the server's one backend)")
    return_token_ids: bool = False
    return_meta_info: bool = Field(False, description="SGLang-style meta_info (spec_accept_length, spec_verify_ct)")
    user: str | None = None


_HI = [{"role": "user", "content": "Hi!"}]
_CARD = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"]}


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [
        {"messages": _HI, "max_tokens": 16},
        {"messages": _HI, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stream": True},
        {"messages": _HI, "max_tokens": 32, "temperature": 0,
         "response_format": {"type": "json_schema", "json_schema": {"name": "card", "schema": _CARD}}},
        {"messages": _HI, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}},
    ]})
    messages: list[ChatMessage] = _stated(..., minItems=1)
    max_completion_tokens: int | None = _stated(minimum=1)
    logprobs: bool | None = False
    top_logprobs: int | None = _stated(minimum=0, maximum=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}; '
                          'default "auto" when tools are given')
    parallel_tool_calls: bool | None = True
    # vLLM's values; passed to the chat template as `reasoning_effort` (GPT-OSS's harmony template reads it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


def _state_prompt(schema: dict[str, Any]) -> None:
    """One text, one token-id list, or a batch of up to MAX_PROMPTS of either; none of them empty."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    schema["anyOf"] = [{"type": "string", "minLength": 1}, ids,
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                        "maxItems": MAX_PROMPTS},
                       {"type": "array", "items": ids, "minItems": 1, "maxItems": MAX_PROMPTS}]


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [
        {"prompt": "Once upon a time", "max_tokens": 16},
        {"prompt": "Phone: ", "max_tokens": 12, "structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
    ]})
    prompt: str | list[int] | list[str] | list[list[int]] = Field(..., json_schema_extra=_state_prompt)
    logprobs: int | None = _stated(minimum=0, maximum=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = _stated(maxLength=0, description="not supported (must be empty)")


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the prefix cache (their K/V not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpecDecodeStats(BaseModel):
    """Per-request speculative decoding: tau = tokens committed per verify step."""

    tau: float
    accepted_per_position: list[int]
    steps: int
    prompt_tokens: int
    completion_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    cached_tokens: int
    prefill_time_s: float
    decode_time_s: float
    decode_tok_s: float


class MetaInfo(BaseModel):
    """SGLang's meta_info, read by z-lab's `dflash benchmark openai` client."""

    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    spec_accept_length: float
    spec_verify_ct: int
    e2e_latency: float


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    spec_decode: SpecDecodeStats | None = None
    meta_info: MetaInfo | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    spec_decode: SpecDecodeStats | None = None
    meta_info: MetaInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "blockspec"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
