"""Pass rates on the scored eval suites: the final number of a GSM8K response, a HumanEval response's program
run against the task's tests in a separate, isolated interpreter (model code never runs in this process).

Model-written code runs with limits (:class:`ProgramLimits`): address space (RLIMIT_AS), CPU seconds (RLIMIT_CPU),
size of files written (RLIMIT_FSIZE), no core dumps, a wall-clock timeout after which its whole process group is
killed, and no new processes: the interpreter's process-creating calls are disabled before the program runs, and
RLIMIT_NPROC caps the user's processes (the kernel does not apply that cap to root). A program that breaks a limit
fails; the group is killed whenever the program ends, so nothing it started outlives the run. This guards the
machine against accidents (a memory bomb, a fork bomb, an endless loop), not against hostile code: run untrusted
code in a real sandbox.

The scorers are pure apart from :func:`run_program`'s subprocess; ``scripts/kernels/bench_quant.py --pass-rate`` uses them
to compare weight formats.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Sequence

from dflash2.bench.datasets import reference_rows

SCORED_SUITES = ("humaneval", "gsm8k")
RUN_TIMEOUT_S = 10.0
_NO_NEW_PROCESSES = (  # run by ``python -I -c`` before the program: process-creating calls raise
    "import os, runpy, sys\n"
    "def _refused(*args, **kwargs):\n"
    "    raise PermissionError('the scorer does not let programs start processes')\n"
    "for _name in ('fork', 'forkpty', 'vfork', 'posix_spawn', 'posix_spawnp', 'system', 'popen', 'spawnl', 'spawnle',"
    " 'spawnlp', 'spawnlpe', 'spawnv', 'spawnve', 'spawnvp', 'spawnvpe', 'execl', 'execle', 'execlp', 'execlpe',"
    " 'execv', 'execve', 'execvp', 'execvpe'):\n"
    "    if hasattr(os, _name):\n"
    "        setattr(os, _name, _refused)\n"
    "import _posixsubprocess\n"
    "_posixsubprocess.fork_exec = _refused\n"
    "sys.argv = sys.argv[1:]\n"
    "del _name, _refused\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
# A minus (not one between operands: "10-5" is 5), an optional $, then 1,234,567 or 1234567, then an optional
# decimal part ("18." stays 18).
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_ANSWER_CUES = (re.compile(r"####"), re.compile(r"answer\s+is", re.IGNORECASE))
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")


@dataclass(frozen=True)
class HumanEvalTask:
    task_id: str
    prompt: str  # the function signature and docstring the model was asked to implement
    entry_point: str
    test: str  # defines check(candidate)


@dataclass(frozen=True)
class GSM8KItem:
    prompt_id: str
    answer: Decimal  # the number after the reference's "####"


@dataclass(frozen=True)
class Score:
    passed: bool
    detail: str  # the extracted answer (GSM8K) or how the program ended (HumanEval)


@dataclass(frozen=True)
class ProgramLimits:
    """What a model-written program may use (see the module docstring)."""

    memory_bytes: int = 1 << 30  # address space (RLIMIT_AS)
    cpu_seconds: int | None = None  # CPU time (RLIMIT_CPU); None: the wall timeout + 2 s (the timeout ends it first)
    file_bytes: int = 64 << 20  # largest file it may write (RLIMIT_FSIZE)
    extra_processes: int = 16  # RLIMIT_NPROC = the user's tasks now + this (not enforced for root)


DEFAULT_LIMITS = ProgramLimits()


@dataclass(frozen=True)
class RunResult:
    passed: bool
    reason: str  # "passed" | "exit N" (N < 0: killed by signal -N, e.g. -24 past its CPU time) | "timeout"
    seconds: float
    stderr_tail: str


# --- GSM8K -------------------------------------------------------------------------------------------------


def parse_number(text: str) -> Decimal | None:
    """The first number in ``text`` ("$1,234.50" -> 1234.50, "-3." -> -3), or None."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    digits = re.sub(r"[$,]", "", match.group())
    try:
        return Decimal(digits)
    except InvalidOperation:  # pragma: no cover - the pattern only matches valid decimals
        return None


def boxed_content(text: str) -> str | None:
    r"""The contents of the last ``\boxed{...}`` (braces nested inside are kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth < 0:
            return text[begin:index]
    return text[begin:]  # unclosed (the response was cut): what there is


def final_answer(response: str) -> Decimal | None:
    r"""The model's final number: in the last \boxed{}, else the first after the last "####" or "answer is",
    else the last number in the text."""
    boxed = boxed_content(response)
    if boxed is not None and parse_number(boxed) is not None:
        return parse_number(boxed)
    for cue in _ANSWER_CUES:
        cues = list(cue.finditer(response))
        if cues and (number := parse_number(response[cues[-1].end():])) is not None:
            return number
    numbers = _NUMBER.findall(response)
    return parse_number(numbers[-1]) if numbers else None


def reference_answer(answer: str) -> Decimal:
    """The number after a GSM8K reference's "####"."""
    if "####" not in answer:
        raise ValueError(f"GSM8K reference without '####': {answer[-80:]!r}")
    number = parse_number(answer.rsplit("####", 1)[1])
    if number is None:
        raise ValueError(f"GSM8K reference without a number after '####': {answer[-80:]!r}")
    return number


def score_gsm8k(item: GSM8KItem, response: str) -> Score:
    answer = final_answer(response)
    return Score(answer is not None and answer == item.answer, "none" if answer is None else str(answer))


# --- HumanEval -----------------------------------------------------------------------------------------------


def extract_code(response: str, entry_point: str) -> str:
    """The code of a chat response: the first ```python block that defines ``entry_point``, else the first
    ```python block, else the first fenced block, else the whole text (an unclosed fence runs to the end)."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(response)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    for body in python:
        if defines(body, entry_point):
            return body
    if python:
        return python[0]
    return blocks[0][1] if blocks else response


def defines(code: str, name: str) -> bool:
    """Whether ``code`` has a ``def name(`` (at any indentation)."""
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def prompt_imports(prompt: str) -> str:
    """The prompt's top-level import lines (a model that rewrites the function often leaves them out)."""
    lines = [line for line in prompt.splitlines() if re.match(r"(?:import|from)\s+\w", line)]
    return "\n".join(lines)


def humaneval_program(task: HumanEvalTask, response: str) -> str:
    """The program to run: the response's code (after the task prompt when it does not define the entry
    point), the task's tests, ``check(entry_point)``."""
    code = extract_code(response, task.entry_point)
    head = prompt_imports(task.prompt) + "\n\n" + code if defines(code, task.entry_point) else task.prompt + code
    return f"{head}\n\n\n{task.test}\n\ncheck({task.entry_point})\n"


def run_program(program: str, timeout: float = RUN_TIMEOUT_S, limits: ProgramLimits = DEFAULT_LIMITS) -> RunResult:
    """Run ``program`` with ``python -I`` in a fresh temp directory under ``limits``; passed = exit status 0 within
    ``timeout``. The child gets its own session, killed as a whole when the program ends or times out."""
    start = time.perf_counter()
    cpu_seconds = limits.cpu_seconds or int(timeout) + 2
    apply_limits = _limit_setter(limits, cpu_seconds)
    with tempfile.TemporaryDirectory(prefix="dflash2-humaneval-") as folder:
        path = Path(folder) / "program.py"
        path.write_text(program, encoding="utf-8")
        process = subprocess.Popen([sys.executable, "-I", "-c", _NO_NEW_PROCESSES, str(path)], cwd=folder,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True, preexec_fn=apply_limits)
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return RunResult(False, "timeout", time.perf_counter() - start, "")
        _kill_group(process)  # whatever it started and left behind
    tail = stderr.decode("utf-8", "replace")[-500:]
    reason = "passed" if process.returncode == 0 else f"exit {process.returncode}"
    return RunResult(process.returncode == 0, reason, time.perf_counter() - start, tail)


def _limit_setter(limits: ProgramLimits, cpu_seconds: int):
    """The child's preexec_fn: set the resource limits (everything computed here, in the parent)."""
    settings = [(resource.RLIMIT_AS, limits.memory_bytes), (resource.RLIMIT_CPU, cpu_seconds),
                (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_CORE, 0)]
    tasks = _user_tasks()
    if tasks is not None:
        settings.append((resource.RLIMIT_NPROC, tasks + limits.extra_processes))
    settings = [(which, _within_hard_limit(which, value)) for which, value in settings]

    def apply() -> None:
        for which, (soft, hard) in settings:
            resource.setrlimit(which, (soft, hard))

    return apply


def _within_hard_limit(which: int, value: int) -> tuple[int, int]:
    """(soft, hard) limits of ``value``, never above the current hard limit (only root may raise it)."""
    _, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    if which == resource.RLIMIT_CPU:  # past the soft limit SIGXCPU; one second later SIGKILL
        return value, value + 1 if hard == resource.RLIM_INFINITY else min(value + 1, hard)
    return value, value


def _user_tasks() -> int | None:
    """Processes and threads of this user now (RLIMIT_NPROC counts them all), or None where /proc is missing."""
    uid = os.getuid()
    count = 0
    try:
        entries = os.scandir("/proc")
    except OSError:
        return None
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/status", "rb") as status:
                    fields = dict(line.split(b":", 1) for line in status if b":" in line)
            except OSError:
                continue  # it ended meanwhile
            if int(fields.get(b"Uid", b"-1 ").split()[0]) == uid:
                count += int(fields.get(b"Threads", b"1").strip() or 1)
    return count


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.communicate()


def score_humaneval(task: HumanEvalTask, response: str, timeout: float = RUN_TIMEOUT_S,
                    limits: ProgramLimits = DEFAULT_LIMITS) -> Score:
    result = run_program(humaneval_program(task, response), timeout, limits)
    error = result.stderr_tail.strip().splitlines()[-1:]  # e.g. "AssertionError", "NameError: ..."
    return Score(result.passed, " | ".join([result.reason, *error]))


# --- suites --------------------------------------------------------------------------------------------------

Reference = HumanEvalTask | GSM8KItem


def load_references(suite: str, data: str | Path | None = None) -> dict[str, Reference]:
    """The references of a scored suite keyed by the prompt ids :func:`load_suite` gives."""
    rows = reference_rows(suite, data)
    if suite == "humaneval":
        return {row["task_id"]: HumanEvalTask(row["task_id"], row["prompt"], row["entry_point"], row["test"])
                for row in rows}
    return {str(i): GSM8KItem(str(i), reference_answer(row["answer"])) for i, row in enumerate(rows)}


def score(reference: Reference, response: str, timeout: float = RUN_TIMEOUT_S,
          limits: ProgramLimits = DEFAULT_LIMITS) -> Score:
    if isinstance(reference, HumanEvalTask):
        return score_humaneval(reference, response, timeout, limits)
    return score_gsm8k(reference, response)


def first_divergence(ids: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where ``ids`` and ``reference`` differ (the shorter length when one is a
    prefix of the other); None when they are identical."""
    for index, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return index
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


@dataclass(frozen=True)
class FormatSummary:
    weights: str
    suite: str
    prompts: int
    passed: int
    identical: int  # responses token-for-token equal to the first format's
    divergences: list[int | None]  # per prompt: first differing token index, None when identical


def summarize_pass_rates(rows: Sequence[dict]) -> list[FormatSummary]:
    """Per (weights, suite), in first-seen order, from rows with weights, suite, passed, first_divergence."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["weights"], row["suite"]), []).append(row)
    return [FormatSummary(weights, suite, len(group), sum(r["passed"] for r in group),
                          sum(r["first_divergence"] is None for r in group), [r["first_divergence"] for r in group])
            for (weights, suite), group in groups.items()]


def pass_rate_table(summaries: Sequence[FormatSummary], baseline: str) -> str:
    """A Markdown table: pass rate, identical responses and first divergences per format and suite."""
    lines = [f"| weights | suite | pass rate | identical to {baseline} | first divergence (token) |",
             "| --- | --- | --- | --- | --- |"]
    for s in summaries:
        divergences = ", ".join("-" if d is None else str(d) for d in s.divergences)
        lines.append(f"| {s.weights} | {s.suite} | {s.passed}/{s.prompts} ({s.passed / s.prompts:.0%}) | "
                     f"{s.identical}/{s.prompts} | {divergences} |")
    return "\n".join(lines)
