"""The OpenAI wire format: request bodies (validated strictly), OpenAI-style errors, response and chunk bodies.

Fields that would change the output and are not implemented (penalties, logit_bias, n > 1, unknown fields) are
refused with a 400 that names them, never silently ignored. Fields that change nothing here (``INERT_FIELDS``:
store, metadata, user, ...) are accepted and ignored; the server logs one line per request naming them. The
extension field ``dflash2`` picks the drafter and draft length of one request:
``{"dflash2": {"drafter": "ngram", "num_draft_tokens": 4}}`` (``extra_body`` in the openai client).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dflash2.verify.sampling import SEED_RANGE

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
# accepted and ignored (logged): they change nothing in what this server generates
INERT_FIELDS = ("store", "metadata", "parallel_tool_calls", "service_tier", "user", "prediction")


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Dflash2Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    drafter: str | None = None  # "none", "ngram", "model" (when the server holds a draft model)
    num_draft_tokens: int | None = Field(None, ge=0, le=64)  # 0 = plain decoding for this request
    top_k: int = Field(0, ge=0)
    timeout_s: float | None = Field(None, gt=0)  # a deadline for this request (at most the server's)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    include_obfuscation: bool | None = None  # inert: nothing here is obfuscated


class _Common(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context (or the server's --max-tokens)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # below 1e-5 (0 included): greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    dflash2: Dflash2Options = Dflash2Options()
    # accepted only at their neutral values (refused otherwise, see refuse_unsupported)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # inert (INERT_FIELDS): accepted, ignored, logged
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        return tuple(s for s in stops if s)

    def ignored_fields(self) -> list[str]:
        """The inert fields this request set (the server logs them)."""
        return [name for name in INERT_FIELDS if getattr(self, name) is not None]

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported (decoding is lossless: only temperature, top_p, "
                                    "top_k and seed shape sampling)", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")

    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; else how many alternatives per token (0: only the chosen token's)."""
        raise NotImplementedError


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant message (with tool calls)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # what SDKs echo back from an earlier assistant message; nothing here produces them
    refusal: str | None = None
    annotations: list[Any] | None = None

    @model_validator(mode="after")
    def _content_rules(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs a json_schema object")
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names():
            raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        if choice == "required" and not self.tools:
            raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
        structured = self.response_format is not None and self.response_format.type != "text"
        if structured and self.tools and choice != "none":
            raise ApiError(400, "response_format with tools is not supported; pass tool_choice 'none' or no "
                                "response_format", param="response_format")

    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int = Field(1, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (0: the chosen one's)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")

    def token_limit(self) -> int | None:
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        return self.logprobs
