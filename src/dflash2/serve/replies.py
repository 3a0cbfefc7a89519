"""What a request asks beyond plain text, turned into the engine's terms and back: the chat prompt with tools, the
request's constraint (a grammar for ``response_format`` / a required tool call, logprobs), and the reply's choices
(tool calls parsed from the text, logprobs of the tokens each chunk carries)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from dflash2.decode.output import GenerationResult, StreamChunk
from dflash2.serve.protocol import ApiError, ChatCompletionRequest, NamedToolChoice
from dflash2.serve.responses import (
    chat_delta,
    chat_logprobs,
    chat_message,
    completion_choice,
    completion_logprobs,
    finish_reason,
)
from dflash2.serve.structured import GrammarUnavailable, Grammars, RequestConstraint, TokenLogprob, XgrammarState
from dflash2.serve.tools import (
    ToolCallStream,
    parse_reply,
    template_messages,
    tool_definitions,
    tool_schemas,
    tools_system_message,
)


def chat_prompt(engine, body: ChatCompletionRequest) -> list[int]:
    """The prompt ids of a chat request: messages (tool calls and results too) and, unless ``tool_choice`` is
    "none", the tools, through the model's chat template (or a system message where it renders no tools)."""
    tokenizer = engine.tokenizer
    native = bool(getattr(tokenizer, "renders_tools", False))
    messages = template_messages(body, native)
    tools = tool_definitions(body) if body.tools and body.tool_choice != "none" else None
    if tools and native:
        return tokenizer.apply_chat_template(messages, tools)
    if tools:
        messages = [tools_system_message(tools), *messages]
    return engine.encode_prompt(messages)


def calls_tools(body) -> bool:
    """The reply is parsed for tool calls (tools offered and not turned off)."""
    return isinstance(body, ChatCompletionRequest) and bool(body.tools) and body.tool_choice != "none"


async def request_constraint(body, grammars: Grammars | None, vocab: int) -> RequestConstraint | None:
    """The request's constraint: a grammar (``response_format`` json_object / json_schema, ``tool_choice``
    required or a named function) and / or logprobs; None when it needs neither."""
    top = body.top_logprobs_count()
    compiled = None
    if isinstance(body, ChatCompletionRequest):
        compiled = await _grammar(body, grammars)
    if compiled is None and top is None:
        return None
    return RequestConstraint(None if compiled is None else XgrammarState(compiled), vocab, top)


async def _grammar(body: ChatCompletionRequest, grammars: Grammars | None):
    form = body.response_format
    forced = body.tools and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice))
    if (form is None or form.type == "text") and not forced:
        return None
    param = "response_format" if not forced else "tool_choice"
    if grammars is None:
        raise ApiError(400, "this model's tokenizer cannot drive a grammar", param=param)
    try:
        if forced:
            return await asyncio.to_thread(grammars.tool_call, tool_schemas(body))
        schema = form.json_schema.json_schema if form.type == "json_schema" else {"type": "object"}
        return await asyncio.to_thread(grammars.json_schema, schema)
    except GrammarUnavailable as error:
        raise ApiError(501, str(error), type="server_error", param=param, code="grammar_unavailable") from None
    except (RuntimeError, ValueError) as error:  # xgrammar's errors on a schema it cannot compile
        raise ApiError(400, f"the schema cannot be compiled: {error}", param=param) from None


@dataclass
class Reply:
    """The choices of one response, whole or chunk by chunk."""

    chat: bool
    tokenizer: Any
    constraint: RequestConstraint | None
    tools: bool  # parse tool calls out of the text
    tool_names: tuple[str, ...] = ()  # the offered tools: a fenced JSON call of one of them counts (serve/tools.py)
    _logprobs_sent: int = 0
    _chars_sent: int = 0
    _stream: ToolCallStream | None = None
    _called: bool = False  # a tool call was sent

    def body_choice(self, result: GenerationResult) -> dict:
        entries = self._entries(len(result.token_ids))
        if not self.chat:
            return completion_choice(result.text, finish_reason(result.finish_reason), self._logprobs(entries))
        parsed = parse_reply(result.text, self.tool_names) if self.tools else None
        calls = parsed.tool_calls if parsed else []
        content = parsed.content if parsed else result.text
        return chat_message(content, calls, finish_reason(result.finish_reason, bool(calls)), self._logprobs(entries))

    def chunk_choice(self, chunk: StreamChunk) -> dict | None:
        """The choice of one streamed chunk (None: nothing to send yet)."""
        entries = self._entries(len(chunk.token_ids))
        logprobs = self._logprobs(entries)
        if not self.chat:
            return completion_choice(chunk.text, None, logprobs) if chunk.text or entries else None
        text, calls = self._split(chunk.text)
        if not text and not calls and not entries:
            return None
        return chat_delta(text or None, None, tool_calls=calls or None, logprobs=logprobs)

    def final_choice(self, result: GenerationResult) -> dict:
        if not self.chat:
            return completion_choice("", finish_reason(result.finish_reason))
        rest = self._stream.flush() if self._stream else ""
        return chat_delta(rest or None, finish_reason(result.finish_reason, self._called))

    def _split(self, text: str) -> tuple[str, list[dict]]:
        if not self.tools:
            return text, []
        self._stream = self._stream or ToolCallStream(self.tool_names)
        text, calls = self._stream.push(text)
        self._called = self._called or bool(calls)
        return text, calls

    def _entries(self, count: int) -> list[TokenLogprob] | None:
        """The logprobs of the next ``count`` generated tokens (None without logprobs)."""
        if self.constraint is None or self.constraint.top_logprobs is None:
            return None
        entries = self.constraint.logprobs[self._logprobs_sent : self._logprobs_sent + count]
        self._logprobs_sent += len(entries)
        return entries

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.tokenizer)
        body = completion_logprobs(entries, self.tokenizer, self._chars_sent)
        self._chars_sent += sum(len(token) for token in body["tokens"])
        return body
