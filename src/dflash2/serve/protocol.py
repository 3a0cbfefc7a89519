"""The OpenAI wire format: request bodies (validated strictly), OpenAI-style errors, response and chunk bodies.

Fields the engine does not implement (logprobs, tools, penalties, n > 1, ...) are refused with a 400 that
names them, never silently ignored. The extension field ``dflash2`` picks the drafter and draft length of one
request: ``{"dflash2": {"drafter": "ngram", "num_draft_tokens": 4}}`` (``extra_body`` in the openai client).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash2.decode.output import GenerationResult
from dflash2.verify.sampling import SEED_RANGE

MAX_STOP_STRINGS = 4


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


class _Common(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # below 1e-5 (0 included): greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    dflash2: Dflash2Options = Dflash2Options()
    # accepted only at their neutral values (refused otherwise, see refuse_unsupported)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        return tuple(s for s in stops if s)

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported (decoding is lossless: only temperature, top_p, "
                                    "top_k and seed shape sampling)", param=name)
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def chat(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int = Field(1, ge=1, le=1)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")

    def token_limit(self) -> int | None:
        return self.max_tokens


def finish_reason(engine_reason: str) -> str:
    """Engine finish reasons (eos, stop, length, timeout) in OpenAI terms (stop, length): a deadline cuts the
    output like a token limit (the ``dflash2`` extension names the reason)."""
    return "length" if engine_reason in ("length", "timeout") else "stop"


@dataclass
class ResponseIds:
    """The id, creation time and model name every body and chunk of one response repeats."""

    id: str
    created: int
    model: str

    @staticmethod
    def new(prefix: str, model: str) -> ResponseIds:
        return ResponseIds(f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), model)

    def header(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}


def usage(result: GenerationResult) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens taken from the prefix cache."""
    prompt_tokens, completion_tokens = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.stats.cached_tokens}}


def chat_choice(text: str | None, reason: str | None, *, delta: bool, first: bool = False) -> dict:
    """One choice of a chat body (``message``) or chunk (``delta``)."""
    if not delta:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                "logprobs": None}
    body: dict[str, Any] = {}
    if first:
        body["role"] = "assistant"
    if text is not None:
        body["content"] = text
    return {"index": 0, "delta": body, "finish_reason": reason, "logprobs": None}


def completion_choice(text: str, reason: str | None) -> dict:
    return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
