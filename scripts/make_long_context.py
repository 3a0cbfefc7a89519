#!/usr/bin/env python
"""Write the bench's long-context suite (data/eval/long_context/): prompts of 4-16K tokens, each a source file of a
permissively licensed Python package (as installed in the environment, whole or its first lines) followed by a
question about it: what coding assistants, RAG and agents send, where verification runs over thousands of cached
positions.

    python scripts/make_long_context.py                 # writes prompts.jsonl.gz and the packages' licenses
    python scripts/make_long_context.py --check         # token counts with the default target's tokenizer

The files are read from the installed packages (their version is recorded per prompt), so the suite is rebuilt
only on purpose; the bench reads the written file (``dflash2.bench.datasets``, suite ``long_context``).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata as metadata
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "eval" / "long_context"


@dataclass(frozen=True)
class Source:
    prompt_id: str
    package: str  # distribution name
    path: str  # file inside the installed package
    max_chars: int  # the file's first lines up to this many characters (whole lines)
    license: str  # SPDX expression, as the distribution declares it
    question: str


SOURCES = (
    Source("h11-connection", "h11", "h11/_connection.py", 60_000, "MIT",
           "How does this Connection class decide where a response body ends (Content-Length, chunked transfer "
           "encoding, connection close)? Point to the functions involved, then write a short example that sends "
           "one request and reads its response with these classes."),
    Source("requests-sessions", "requests", "requests/sessions.py", 60_000, "Apache-2.0",
           "Explain how Session.request merges the per-request settings with the session's own (headers, cookies, "
           "proxies, verify). Then write a function that retries a GET with exponential backoff using a Session."),
    Source("jinja2-lexer", "jinja2", "jinja2/lexer.py", 60_000, "BSD-3-Clause",
           "Describe the lexer's state machine: which rules are active in which state, and how raw blocks and line "
           "statements are handled. Then write a helper that counts the variable expressions in a template source."),
    Source("idna-core", "idna", "idna/core.py", 60_000, "BSD-3-Clause",
           "What does check_bidi enforce, rule by rule? Write pytest tests for one label that passes and three "
           "that fail for different reasons."),
    Source("werkzeug-rules", "werkzeug", "werkzeug/routing/rules.py", 60_000, "BSD-3-Clause",
           "How does a Rule turn its rule string into a regular expression and a URL builder? Explain the role of "
           "converters and weights, then add a rule for /users/<int:user_id>/posts/<slug> and show what it "
           "matches."),
    Source("requests-models", "requests", "requests/models.py", 60_000, "Apache-2.0",
           "Explain how PreparedRequest.prepare_body chooses between a JSON body, form data, files and a stream, "
           "and which headers it sets in each case. Then write a test for the JSON case."),
    Source("packaging-specifiers", "packaging", "packaging/specifiers.py", 60_000, "Apache-2.0 OR BSD-2-Clause",
           "How do Specifier and SpecifierSet decide whether a version matches, and how are pre-releases treated? "
           "Give three examples with their results and explain each."),
    Source("click-types", "click", "click/types.py", 60_000, "BSD-3-Clause",
           "Following the conventions of this file, write a new ParamType that accepts a size such as 10K, 5M or "
           "2G and converts it to a number of bytes, with its error messages and shell completion."),
)


def package_file(source: Source) -> Path:
    dist = metadata.distribution(source.package)
    for f in dist.files or ():
        if str(f) == source.path:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{source.path} is not in the installed {source.package}")


def head_lines(text: str, max_chars: int) -> str:
    """The text's first whole lines within ``max_chars`` characters."""
    if len(text) <= max_chars:
        return text
    return text[: text.rfind("\n", 0, max_chars) + 1]


def license_files(package: str) -> list[Path]:
    dist = metadata.distribution(package)
    return [Path(dist.locate_file(f)) for f in dist.files or ()
            if ".dist-info" in str(f) and f.name.upper().startswith(("LICENSE", "LICENCE", "NOTICE", "COPYING"))]


def build() -> list[dict]:
    rows = []
    for source in SOURCES:
        path = package_file(source)
        code = head_lines(path.read_text(encoding="utf-8"), source.max_chars)
        version = metadata.version(source.package)
        text = (f"Here is the file {source.path} of {source.package} {version}:\n\n```python\n{code}```\n\n"
                f"{source.question}")
        rows.append({"prompt_id": source.prompt_id, "package": source.package, "version": version,
                     "path": source.path, "license": source.license, "chars": len(code), "text": text})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="print token counts with the default target's tokenizer")
    args = ap.parse_args()
    rows = build()
    if args.check:
        from dflash2.models.store import resolve_model
        from dflash2.models.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_model("qwen2.5-coder-1.5b-instruct", "bf16"))
        for row in rows:
            print(f"{row['prompt_id']:>22}: {len(tokenizer.encode(row['text']))} tokens, {row['chars']} chars")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    with gzip.open(OUT / "prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    licenses = OUT / "licenses"
    shutil.rmtree(licenses, ignore_errors=True)
    licenses.mkdir()
    for package in sorted({s.package for s in SOURCES}):
        for path in license_files(package):
            shutil.copyfile(path, licenses / f"{package}-{path.name}")
    print(f"wrote {len(rows)} prompts to {OUT}")


if __name__ == "__main__":
    main()
