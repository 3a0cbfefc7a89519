"""Deterministic prompt sources for drafter training data (the target writes the responses).

- ``gsm8k``: the questions of GSM8K train (MIT; the repository's data/train, see data/README.md).
- ``stdlib``: code prompts built from the docstrings of documented functions of the Python standard library.
- ``chat``: general assistant tasks (writing, role-play, reasoning, extraction, STEM, humanities) over everyday
  topics, written for this project: the conversational prose of MT-bench-like requests, which the other two
  sources lack.

Every source yields the same stream on every run (resumable generation skips the prompts already handled).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

PROMPT_SOURCES = ("gsm8k", "stdlib", "chat")

# Pure-Python standard-library modules whose documented functions become code prompts (sorted, deterministic).
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "colorsys", "configparser", "csv",
    "dataclasses", "difflib", "email.utils", "fnmatch", "fractions", "ftplib", "functools", "getopt", "glob",
    "gzip", "heapq", "html", "imaplib", "inspect", "ipaddress", "json", "logging", "mimetypes", "ntpath",
    "operator", "os", "pathlib", "pkgutil", "platform", "posixpath", "pprint", "quopri",
    "random", "re", "sched", "secrets", "shlex", "shutil", "smtplib", "statistics", "string", "tarfile",
    "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing", "urllib.parse", "urllib.request",
    "uuid", "warnings", "wave", "zipfile",
)

# Shipped in the checkout's data/train (src/dflash2/train/prompts.py -> <checkout>); elsewhere pass a path.
DEFAULT_GSM8K_PATH = Path(__file__).resolve().parents[3] / "data" / "train" / "gsm8k_train.jsonl"


@dataclass(frozen=True)
class Prompt:
    source: str  # "gsm8k" | "stdlib" | "chat"
    text: str


# ---- prompt sources ---------------------------------------------------------------------------------------


def gsm8k_prompts(path: str | Path = DEFAULT_GSM8K_PATH) -> Iterator[str]:
    """The ``question`` field of each line of a GSM8K jsonl file, in file order."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"GSM8K train questions not found at {path} (the repository ships them in "
                                "data/train/; outside a source checkout pass --gsm8k PATH)")
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)["question"].strip()


def stdlib_prompts(modules: Sequence[str] = STDLIB_MODULES) -> Iterator[str]:
    """Code prompts from documented public functions and methods of standard-library modules.

    Three templates (write / explain / reimplement) rotate in a fixed order; everything is sorted, so the
    stream is the same on every run of the same Python version.
    """
    templates = (
        "Write a Python {kind} `{name}{signature}`. {summary}",
        "Explain what the Python {kind} `{qualified}` does, then show a short example of using it. "
        "Its documentation begins: \"{summary}\"",
        "Implement a function like `{qualified}{signature}` from scratch in Python, with comments. "
        "Documentation: {summary}",
    )
    index = 0
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for qualified, function in _documented_functions(module):
            summary = _summary(function.__doc__ or "")
            if len(summary.split()) < 5 or summary.startswith(">>>"):
                continue
            try:
                signature = str(inspect.signature(function))
            except (TypeError, ValueError):
                signature = "(...)"
            kind = "method" if "." in qualified else "function"
            yield templates[index % len(templates)].format(
                kind=kind, name=qualified, signature=signature, qualified=f"{module_name}.{qualified}", summary=summary
            )
            index += 1


def _documented_functions(module) -> Iterator[tuple[str, Callable]]:
    """(name within the module, function) of public Python functions defined in ``module`` and its classes."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for method_name, method in sorted(vars(obj).items()):
                if not method_name.startswith("_") and inspect.isfunction(method):
                    yield f"{name}.{method_name}", method


def _summary(doc: str, limit: int = 400) -> str:
    """The docstring's first paragraph, whitespace collapsed, at most ``limit`` characters."""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return re.sub(r"\s+", " ", paragraph).strip()[:limit]


def iter_prompts(
    sources: Sequence[str] = ("gsm8k", "stdlib"), gsm8k_path: str | Path | None = None
) -> Iterator[Prompt]:
    """The named sources interleaved round-robin (an exhausted source drops out)."""
    streams = []
    for source in sources:
        if source == "gsm8k":
            streams.append((source, gsm8k_prompts(gsm8k_path or DEFAULT_GSM8K_PATH)))
        elif source == "stdlib":
            streams.append((source, stdlib_prompts()))
        elif source == "chat":
            streams.append((source, chat_prompts()))
        else:
            raise ValueError(f"unknown prompt source {source!r}; choose from {', '.join(PROMPT_SOURCES)}")
    while streams:
        alive = []
        for source, stream in streams:
            text = next(stream, None)
            if text is not None:
                alive.append((source, stream))
                yield Prompt(source, text)
        streams = alive


# Chat tasks: one template per kind of request, {topic} filled from CHAT_TOPICS.
CHAT_TASKS = (
    "Write a short blog post about {topic} for a general audience.",
    "Write a friendly, persuasive email encouraging a friend to learn more about {topic}.",
    "Write a short poem about {topic}.",
    "Draft a two-minute speech that introduces {topic} to a class of students.",
    "Imagine you are a tour guide and an expert on {topic}. Greet your visitors and tell them what makes it "
    "interesting.",
    "Pretend you are a journalist interviewing an expert on {topic}. Write three questions and the expert's answers.",
    "What are the main advantages and disadvantages of {topic}? Reason step by step.",
    "A friend says that {topic} is overrated. Give a balanced, well-reasoned reply.",
    "List five key facts about {topic} as bullet points, then summarize them in one sentence.",
    "Make a Markdown table of three important aspects of {topic}, with a short description of each.",
    "Explain the science behind {topic} to a high-school student.",
    "How does {topic} work? Explain it simply, with an everyday analogy.",
    "Describe the history of {topic} and why it still matters today.",
    "How has {topic} influenced society and culture?",
    "Give practical tips to a beginner who wants to get started with {topic}.",
    "What are common misconceptions about {topic}? Correct each one briefly.",
)
CHAT_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "climate change", "renewable energy",
    "electric cars", "vaccines", "sleep", "nutrition", "meditation", "the Roman Empire", "the printing press",
    "the Renaissance", "the Industrial Revolution", "jazz music", "impressionist painting", "Shakespeare's plays",
    "the Olympic Games", "chess", "gardening", "baking bread", "coffee", "tea", "remote work", "public libraries",
    "city parks", "bicycles", "trains", "airplanes", "the internet", "smartphones", "social media", "online privacy",
    "artificial intelligence", "robotics", "3D printing", "space exploration", "the Moon landing", "Mars",
    "the human brain", "the immune system", "DNA", "evolution", "honeybees", "coral reefs", "rainforests",
    "deserts", "the oceans", "earthquakes", "weather forecasting", "personal budgeting", "saving for retirement",
    "starting a small business", "job interviews", "public speaking", "learning a second language",
    "volunteering", "recycling", "minimalism", "board games", "video games", "photography", "film making",
    "hiking", "running a marathon", "yoga", "cooking at home", "the history of money", "democracy",
    "the scientific method", "mathematics in nature", "prime numbers", "probability", "music theory",
    "architecture", "bridges", "skyscrapers", "time management", "friendship",
)


def chat_prompts(tasks: Sequence[str] = CHAT_TASKS, topics: Sequence[str] = CHAT_TOPICS) -> Iterator[str]:
    """Every (task, topic) pair once, in a fixed shuffled order (seeded), so neighbours differ in both."""
    pairs = [(task, topic) for task in tasks for topic in topics]
    random.Random(0).shuffle(pairs)
    for task, topic in pairs:
        text = task.format(topic=topic)
        yield text[0].upper() + text[1:]
