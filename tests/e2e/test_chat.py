"""``dflash2 chat`` driven through its standard input on SmolLM2: turns stream, the second turn starts from the first
turn's kept KV cache, /reset forgets, Ctrl-C (SIGINT) stops a reply and not the program; ``generate -`` reads stdin."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.e2e.conftest import SMOLLM2, model_dir

pytestmark = pytest.mark.model

CHAT = [sys.executable, "-m", "dflash2.cli", "chat", "--model", SMOLLM2, "--drafter", "ngram"]
STATS = re.compile(r"\[(\d+) tokens, ([\d.]+) tok/s .*prompt (\d+) tokens, cached (\d+), .*tau ([\d.]+), "
                   r"acceptance by position: ")


def stats_lines(stderr: str) -> list[dict[str, float]]:
    return [{"new": int(m[1]), "tok_s": float(m[2]), "prompt": int(m[3]), "cached": int(m[4]), "tau": float(m[5])}
            for m in STATS.finditer(stderr)]


def test_three_turns_reuse_the_kept_cache_and_reset_forgets():
    model_dir(SMOLLM2, "bf16")
    script = "\n".join([
        "What is the capital of France?", "/stats",
        "And of Italy?", "/stats",
        "Name one river in each.", "/stats",
        "/reset",
        "And of Italy?", "/stats",
        "/exit", "this line is never read",
    ]) + "\n"
    proc = subprocess.run([*CHAT, "--max-new-tokens", "24", "--system", "You answer in one short sentence."],
                          input=script, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    turns = stats_lines(proc.stderr)
    assert len(turns) == 4, proc.stderr
    first, second, third, after_reset = turns
    assert first["cached"] == 0 and all(t["new"] > 0 and t["tok_s"] > 0 and t["tau"] >= 1.0 for t in turns)
    # each later turn prefills only its new message: the earlier turns' KV comes from the kept cache
    assert second["prompt"] > first["prompt"] and second["cached"] >= first["prompt"] - 1
    assert third["prompt"] > second["prompt"] and third["cached"] >= second["prompt"] - 1
    # after /reset the conversation is the system prompt and one message again: shorter than the second turn's
    assert after_reset["prompt"] < second["prompt"]
    assert "conversation cleared" in proc.stderr and "never read" not in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.strip()]) >= 4  # four replies printed


@pytest.mark.slow  # a second chat process (~1 min on a busy 2-core machine); make test-all runs it
def test_sigint_stops_the_reply_not_the_program():
    model_dir(SMOLLM2, "bf16")
    proc = subprocess.Popen([*CHAT, "--max-new-tokens", "2000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    first_output = threading.Event()
    out: list[str] = []

    def read_stdout():
        while piece := proc.stdout.read(1):
            out.append(piece)
            first_output.set()

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        proc.stdin.write("Count from 1 to 1000, one number per line.\n")
        proc.stdin.flush()
        assert first_output.wait(300), "no reply started"
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        proc.stdin.write("/stats\nSay hi.\n/stats\n/exit\n")
        proc.stdin.flush()
        stderr = proc.stderr.read()
        assert proc.wait(300) == 0, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    assert "(stopped)" in stderr
    turns = stats_lines(stderr)
    assert len(turns) == 1, stderr  # the stopped reply has no stats; the next one does
    assert 0 < turns[0]["new"] <= 2000 and len("".join(out)) > 0


def test_generate_reads_the_prompt_from_stdin():
    from dflash2.models.tokenizer import Tokenizer

    directory = model_dir(SMOLLM2, "bf16")
    prompt = "Write a haiku about the sea.\nMake it rhyme."  # two lines: all of stdin is the prompt
    proc = subprocess.run([sys.executable, "-m", "dflash2.cli", "generate", "-", "--model", SMOLLM2,
                           "--max-new-tokens", "4", "--drafter", "none", "--json"], input=prompt,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = Tokenizer(directory).apply_chat_template([{"role": "user", "content": prompt}])
    assert record["prompt_tokens"] == len(expected) and record["new_tokens"] > 0
