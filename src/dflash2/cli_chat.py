"""``dflash2 chat``: a conversation in the terminal, streamed, turn after turn.

Each turn sends the whole conversation (system prompt, earlier turns, the new message) through the model's chat
template; the engine keeps the last generation's KV cache, so a turn prefills only what the kept cache does not
already hold (the new message and the template's tokens around it). ``/stats`` shows it (``cached``).

Ctrl-C during a reply stops that reply at its next chunk (a second Ctrl-C stops it at once) and keeps what was
printed as the assistant's turn; the kept cache goes with it, so the next turn prefills the conversation again.
Ctrl-C at the prompt clears the line. Ctrl-D (end of input) or ``/exit`` quits.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass, field
from typing import TextIO

from dflash2.cli_common import CliError, add_model_options, load_engine

COMMANDS = {
    "/reset": "forget the conversation (the system prompt stays)",
    "/stats": "the last reply's speed, acceptance and cached tokens",
    "/help": "this list",
    "/exit": "quit (or Ctrl-D)",
}


def add_chat_parser(commands) -> None:
    p = commands.add_parser("chat", help="talk with a model in the terminal",
                            description="An interactive conversation: type a message, the reply streams; "
                                        + "; ".join(f"{name}: {what}" for name, what in COMMANDS.items())
                                        + ". Ctrl-C stops a reply.")
    add_model_options(p)
    p.add_argument("--system", default=None, help="system prompt of the conversation")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="longest reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--verbose", action="store_true", help="print the stats line after every reply")
    p.set_defaults(handler=run_chat)


@dataclass
class Conversation:
    """The messages sent each turn: the system prompt (if any), then alternating user / assistant turns."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, user_text: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns + [{"role": "user", "content": user_text}]

    def add(self, user_text: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]

    def reset(self) -> None:
        self.turns.clear()


class ReplyInterrupt:
    """While a reply streams: the first SIGINT asks it to stop at the next chunk, a second raises
    KeyboardInterrupt at once (a long prefill cannot be left any other way)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> "ReplyInterrupt":
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def run_chat(args: argparse.Namespace) -> int:
    if args.max_new_tokens <= 0:
        raise CliError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    engine = load_engine(args)
    if not engine.tokenizer.has_chat_template:
        raise CliError(f"{args.model} has no chat template; use `dflash2 generate --raw` for plain completion")
    interactive = sys.stdin.isatty()
    if interactive:
        _enable_line_editing()
        print(f"dflash2 chat with {args.model} (drafter {args.drafter}); /help for commands, Ctrl-D to quit",
              file=sys.stderr)
    ChatSession(engine, args, Conversation(args.system), interactive).loop()
    return 0


class ChatSession:
    """The read-reply loop over one engine and one conversation."""

    def __init__(self, engine, args: argparse.Namespace, conversation: Conversation, interactive: bool,
                 out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.engine, self.args, self.conversation = engine, args, conversation
        self.interactive, self.out, self.err = interactive, out, err
        self.last = None  # the last reply's GenerationResult

    def loop(self) -> None:
        while True:
            line = self._read()
            if line is None:
                return
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self._command(text):
                    return
                continue
            self._reply(text)

    def _read(self) -> str | None:
        """The next line typed (None at end of input); Ctrl-C at the prompt clears the line."""
        while True:
            try:
                return input(">>> " if self.interactive else "")
            except EOFError:
                if self.interactive:
                    print(file=self.err)
                return None
            except KeyboardInterrupt:
                print("\n(Ctrl-D or /exit quits)", file=self.err)

    def _command(self, text: str) -> bool:
        """Run a slash command; False when it ends the chat."""
        name = text.split()[0].lower()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/reset":
            self.conversation.reset()
            self.engine.clear_cache()
            self.last = None
            print("(conversation cleared)", file=self.err)
        elif name == "/stats":
            print(self.stats_line() if self.last is not None else "(no reply yet)", file=self.err)
        elif name == "/help":
            for command, what in COMMANDS.items():
                print(f"  {command:8s} {what}", file=self.err)
        else:
            print(f"unknown command {name}; /help lists them", file=self.err)
        return True

    def _reply(self, user_text: str) -> None:
        args = self.args
        try:
            stream = self.engine.stream(self.conversation.messages(user_text), max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                        seed=args.seed)
            text, result = self._print_stream(stream)
        except ValueError as error:  # the conversation outgrew the context, for one
            print(f"error: {error}; /reset starts over", file=self.err)
            return
        print(file=self.out, flush=True)
        self.conversation.add(user_text, text)
        if result is None:
            print("(stopped)", file=self.err)
            return
        self.last = result
        if args.verbose:
            print(self.stats_line(), file=self.err)

    def _print_stream(self, stream) -> tuple[str, object]:
        """Print the reply as it streams: its text and the result (None when Ctrl-C stopped it)."""
        pieces: list[str] = []
        try:
            with ReplyInterrupt() as interrupt:
                while not interrupt.requested:
                    try:
                        chunk = next(stream)
                    except StopIteration as done:
                        return "".join(pieces), done.value
                    pieces.append(chunk.text)
                    print(chunk.text, end="", file=self.out, flush=True)
        except KeyboardInterrupt:
            pass
        stream.close()
        return "".join(pieces), None

    def stats_line(self) -> str:
        stats = self.last.stats
        line = (f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.2f} tok/s (decode {stats.decode_tokens_per_s:.2f}), "
                f"prefill {stats.prefill_seconds:.2f}s, prompt {stats.prompt_tokens} tokens, "
                f"cached {stats.cached_tokens}, finish: {self.last.finish_reason}")
        if self.engine.drafter is not None:
            acceptance = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
            line += f", tau {stats.tau:.2f}, acceptance by position: {acceptance or '-'}"
        return line + "]"


def _enable_line_editing() -> None:
    """Arrow keys and history at the prompt, where the platform has readline."""
    try:
        import readline  # noqa: F401  (importing it is what enables it for input())
    except ImportError:
        pass
