"""Response and chunk bodies in OpenAI's format: ids, usage, choices (content, tool calls, logprobs)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from dflash2.decode.output import GenerationResult
from dflash2.serve.structured import TokenLogprob


def finish_reason(engine_reason: str, tool_calls: bool = False) -> str:
    """Engine finish reasons (eos, stop, length, timeout) in OpenAI terms (stop, length, tool_calls): a deadline
    cuts the output like a token limit (the ``dflash2`` extension names the reason)."""
    if engine_reason in ("length", "timeout"):
        return "length"
    return "tool_calls" if tool_calls else "stop"


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


def chat_message(content: str | None, tool_calls: list[dict] | None, reason: str | None,
                 logprobs: dict | None = None) -> dict:
    """The one choice of a chat body."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}


def chat_delta(text: str | None, reason: str | None, *, first: bool = False, tool_calls: list[dict] | None = None,
               logprobs: dict | None = None) -> dict:
    """The one choice of a chat chunk."""
    body: dict[str, Any] = {}
    if first:
        body["role"] = "assistant"
    if text is not None:
        body["content"] = text
    if tool_calls:
        body["tool_calls"] = tool_calls
    return {"index": 0, "delta": body, "finish_reason": reason, "logprobs": logprobs}


def completion_choice(text: str, reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """``choice.logprobs`` of a chat body or chunk: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], tokenizer, offset: int) -> dict:
    """``choice.logprobs`` of a completion body or chunk (legacy format); ``offset``: characters before them."""
    tokens = [tokenizer.decode([e.token]) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}
