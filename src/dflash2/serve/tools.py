"""Tools in chat: messages (tool calls, tool results) and tool definitions for the model's own chat template, and
the model's ``<tool_call>`` output parsed back into OpenAI ``tool_calls``, whole or as streaming deltas.

The format is Hermes' (Qwen2.5's template): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
A template that does not render tools (SmolLM2's) gets the tool list and the format in a system message, and
earlier calls and results as text in the same format.

Fallback: a small model often answers with the call as a fenced JSON block (Qwen2.5-Coder-1.5B under
``tool_choice: auto``) instead of the tags. Where the reply has no tagged call, a fenced block (```json or bare
```) whose JSON is ``{"name": <an offered tool>, "arguments": {...}}`` is that call; only offered names count, so a
reply that merely shows JSON stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Collection

from dflash2.decode.output import _overlap as partial_prefix
from dflash2.serve.protocol import ChatCompletionRequest, ChatMessage

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FENCE = "```"
_FENCED = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def template_messages(body: ChatCompletionRequest, native_tools: bool) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them (``native_tools``: the template renders tool calls
    and tool results itself)."""
    return [_message(m, native_tools) for m in body.messages]


def _message(m: ChatMessage, native_tools: bool) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    if m.role == "assistant" and m.tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
        if native_tools:
            return {"role": role, "content": m.text(),
                    "tool_calls": [{"type": "function", "function": call} for call in calls]}
        text = "\n".join(f"{OPEN}\n{json.dumps(call)}\n{CLOSE}" for call in calls)
        return {"role": role, "content": (m.text() + "\n" + text).lstrip("\n")}
    if m.role == "tool" and not native_tools:
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    return {"role": role, "content": m.text()}


def _arguments(text: str) -> Any:
    """Arguments as an object for the template (it writes them with ``tojson``); text that is not JSON stays text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def tool_definitions(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools or []]


def tools_system_message(tools: list[dict[str, Any]]) -> dict[str, str]:
    """The tool list and call format, for a template that does not render tools (Qwen2.5's wording)."""
    listed = "\n".join(json.dumps(tool) for tool in tools)
    return {"role": "system", "content": (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
        "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')}


def tool_schemas(body: ChatCompletionRequest) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of the tools ``tool_choice`` allows: one for a named function, else all."""
    choice = body.tool_choice
    named = None if isinstance(choice, str) or choice is None else choice.function.name
    return [(t.function.name, t.function.parameters or {"type": "object"}) for t in body.tools or []
            if named is None or t.function.name == named]


@dataclass
class ParsedReply:
    content: str | None  # the text outside the tool calls (None when there is none)
    tool_calls: list[dict[str, Any]]  # OpenAI tool_calls


def parse_reply(text: str, fenced_names: Collection[str] = ()) -> ParsedReply:
    """Split a reply into its text and its well-formed ``<tool_call>`` blocks (a block whose JSON does not parse
    into a name and arguments stays in the text); without any, its fenced JSON calls of ``fenced_names``."""
    parsed = _split_calls(text, _CALL, lambda payload: tool_call(payload))
    if parsed.tool_calls or not fenced_names:
        return parsed
    return _split_calls(text, _FENCED, lambda payload: fenced_call(payload, fenced_names))


def _split_calls(text: str, pattern: re.Pattern, parse: Callable[[str], dict[str, Any] | None]) -> ParsedReply:
    calls, kept, last = [], [], 0
    for match in pattern.finditer(text):
        call = parse(match.group(1).strip())
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return ParsedReply(content or None, calls)


def fenced_call(payload: str, names: Collection[str]) -> dict[str, Any] | None:
    """A fenced block's call: a tool call (as in the tags) whose name is one of ``names``; else None."""
    call = tool_call(payload)
    return call if call is not None and call["function"]["name"] in names else None


def tool_call(payload: str) -> dict[str, Any] | None:
    """An OpenAI tool call from a block's JSON ``{"name": ..., "arguments": ...}``; None if it is not one."""
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)  # a model may write them as text
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"], "arguments": text}}


class ToolCallStream:
    """Streaming: text deltas in, (content delta, finished tool calls) out. Text that may start a ``<tool_call>``
    is held back until it does or cannot; a call is sent whole (name and arguments in one delta) once its
    ``</tool_call>`` arrives; a block that does not parse is sent as content. With ``fenced_names``, a fenced block
    is held back the same way until its closing fence (then a call of one of those names, else content), while no
    tagged call has been sent."""

    def __init__(self, fenced_names: Collection[str] = ()) -> None:
        self.buffer = ""
        self.count = 0  # tool calls sent so far (their delta index)
        self.fenced_names = frozenset(fenced_names)
        self.tagged = False  # a tagged call was sent: fenced blocks are text from then on (as in parse_reply)
        self.after_call = False  # only whitespace since the last call: more of it is not content

    def _marks(self) -> list[tuple[str, str]]:
        fenced = self.fenced_names and not self.tagged
        return [(OPEN, CLOSE), *([(FENCE, FENCE)] if fenced else [])]

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content, calls = [], []
        while True:
            marks = self._marks()
            found = [(self.buffer.find(open_), open_, close) for open_, close in marks if open_ in self.buffer]
            if not found:
                keep = max(partial_prefix(self.buffer, open_) for open_, _ in marks)
                content.append(self._text(self.buffer[: len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            start, open_, close = min(found)
            content.append(self._text(self.buffer[:start]))
            end = self.buffer.find(close, start + len(open_))
            if end < 0:
                self.buffer = self.buffer[start:]
                break
            block = self.buffer[start : end + len(close)]
            self.buffer = self.buffer[end + len(close) :]
            if open_ == OPEN:
                call = tool_call(block[len(OPEN) : -len(CLOSE)].strip())
                self.tagged = self.tagged or call is not None
            else:
                match = _FENCED.fullmatch(block)
                call = None if match is None else fenced_call(match.group(1).strip(), self.fenced_names)
            if call is None:
                content.append(self._text(block))
            else:
                calls.append({"index": self.count, **call})
                self.count += 1
                self.after_call = True
        return "".join(content), calls

    def _text(self, text: str) -> str:
        """Content, less the whitespace that directly follows a call (between calls, after the last one)."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text

    def flush(self) -> str:
        """What is held back at the end (an unfinished block is content)."""
        rest, self.buffer = self.buffer, ""
        return rest
