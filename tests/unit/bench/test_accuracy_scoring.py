import os
import resource
import time
from decimal import Decimal

import pytest

from dflash2.bench.accuracy import (
    GSM8KItem,
    HumanEvalTask,
    ProgramLimits,
    extract_code,
    final_answer,
    first_divergence,
    humaneval_program,
    load_references,
    pass_rate_table,
    reference_answer,
    run_program,
    score,
    score_gsm8k,
    summarize_pass_rates,
)
from dflash2.bench.datasets import reference_rows

TASK = HumanEvalTask(
    task_id="Test/0",
    prompt='from typing import List\n\n\ndef add_all(xs: List[int]) -> int:\n    """Sum of xs."""\n',
    entry_point="add_all",
    test="def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
)


@pytest.mark.parametrize("response, expected", [
    ("She makes 9 * 2 = $18 every day.", "18"),
    ("The total is 1,234,567 apples.", "1234567"),
    ("So she pays $1,200.50.", "1200.50"),
    ("The temperature drops to -7.", "-7"),
    ("Each costs 2.5 dollars, so 4 cost 10.", "10"),
    ("The difference is 10-5", "5"),
    ("The answer is 42. Check: 42 - 2 = 40.", "42"),
    ("Steps: 3 + 4 = 7\n#### 7\nThat was 2 steps.", "7"),
    ("so the result is \\boxed{72}. Then 5 more words with 3.", "72"),
    ("\\boxed{\\$1,000} dollars", "1000"),
    ("\\boxed{18 \\text{ eggs}}", "18"),
    ("no number here", None),
])
def test_final_answer_extraction(response, expected):
    answer = final_answer(response)
    assert answer == (None if expected is None else Decimal(expected))


def test_gsm8k_scores_numerically_against_the_reference_after_hashes():
    item = GSM8KItem("0", reference_answer("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 1,800"))
    assert item.answer == Decimal(1800)
    assert score_gsm8k(item, "She makes \\boxed{1800.00}").passed
    assert score_gsm8k(item, "So the answer is $1,800.").passed
    wrong = score_gsm8k(item, "She makes 18 dollars.")
    assert not wrong.passed and wrong.detail == "18"
    assert not score_gsm8k(item, "I do not know.").passed
    with pytest.raises(ValueError, match="####"):
        reference_answer("no marker 5")


def test_extract_code_prefers_the_python_block_defining_the_entry_point():
    response = ("Example:\n```python\nprint(add_all([1]))\n```\nSolution:\n```python\ndef add_all(xs):\n"
                "    return sum(xs)\n```\nDone.")
    assert extract_code(response, "add_all") == "def add_all(xs):\n    return sum(xs)\n"
    assert extract_code("```\nx = 1\n```", "f") == "x = 1\n"
    assert extract_code("def f():\n    return 1", "f") == "def f():\n    return 1"
    assert extract_code("```python\ndef f():\n    return 1", "f") == "def f():\n    return 1"  # cut off


def test_program_prepends_the_prompt_only_when_the_entry_point_is_missing():
    full = humaneval_program(TASK, "```python\ndef add_all(xs: List[int]) -> int:\n    return sum(xs)\n```")
    assert full.count("def add_all") == 1 and full.startswith("from typing import List")
    body = humaneval_program(TASK, "    return sum(xs)\n")
    assert body.startswith(TASK.prompt + "    return sum(xs)") and body.endswith("check(add_all)\n")


def test_a_correct_solution_passes_and_a_wrong_one_fails():
    right = score(TASK, "```python\ndef add_all(xs: List[int]) -> int:\n    return sum(xs)\n```")
    assert right.passed, right.detail
    wrong = score(TASK, "```python\ndef add_all(xs: List[int]) -> int:\n    return len(xs)\n```")
    assert not wrong.passed and "AssertionError" in wrong.detail
    assert not score(TASK, "I cannot solve this.").passed  # a syntax error is a failure


def test_an_infinite_loop_times_out_as_a_failure():
    result = run_program("while True:\n    pass\n", timeout=1.0)
    assert not result.passed and result.reason == "timeout" and result.seconds < 5.0


def solved_and(extra: str) -> str:
    """A response with a correct add_all, then ``extra`` in the same code block."""
    return "```python\ndef add_all(xs):\n    return sum(xs)\n\n" + extra + "```\n"


def test_a_memory_bomb_is_stopped_by_the_address_space_limit():
    bomb = solved_and("hoard = []\nwhile True:\n    hoard.append(bytearray(64 << 20))\n")
    result = score(TASK, bomb, timeout=20.0, limits=ProgramLimits(memory_bytes=256 << 20))
    assert not result.passed and "MemoryError" in result.detail and "timeout" not in result.detail


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (not yet reaped by init) is not running
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_bounded_fork_bomb_starts_no_process_and_fails(tmp_path):
    """At most 64 forks (bounded, in case the guard broke): the scorer refuses the first; nothing outlives it."""
    pids = tmp_path / "pids.txt"
    bomb = solved_and(
        "import os, time\n"
        "for _ in range(64):\n"
        "    if os.fork() == 0:\n"
        f"        open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
    )
    result = score(TASK, bomb, timeout=10.0)
    assert not result.passed and "PermissionError" in result.detail, result.detail
    started = [int(pid) for pid in pids.read_text().split()] if pids.exists() else []
    assert started == []
    subprocess_bomb = solved_and("import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'], check=True)\n")
    assert not score(TASK, subprocess_bomb, timeout=10.0).passed


def test_whatever_a_program_leaves_running_is_killed_with_its_group(tmp_path):
    """Even if a process got past the guard, it dies with the group when the program ends (here a thread of the
    program keeps running and the group kill ends it)."""
    marker = tmp_path / "late.txt"
    program = ("import threading, time\n"
               f"threading.Thread(target=lambda: (time.sleep(1.5), open({str(marker)!r}, 'w').write('x')),"
               " daemon=False).start()\n"
               "import os\nos._exit(0)\n")
    assert run_program(program, timeout=10.0).passed
    time.sleep(2.0)
    assert not marker.exists()


def test_the_limits_reach_the_program(tmp_path):
    marker = tmp_path / "limits.txt"
    names = ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE", "RLIMIT_NPROC"]
    program = ("import resource\n"
               f"soft = [resource.getrlimit(getattr(resource, n))[0] for n in {names}]\n"
               f"open({str(marker)!r}, 'w').write(repr(soft))\n")
    limits = ProgramLimits(memory_bytes=512 << 20, cpu_seconds=3, file_bytes=1 << 20)
    assert run_program(program, limits=limits).passed
    memory, cpu, file_size, core, processes = eval(marker.read_text())
    assert (memory, cpu, file_size, core) == (512 << 20, 3, 1 << 20, 0)
    assert processes != resource.RLIM_INFINITY and processes < 100_000  # the user's tasks + 16


def test_a_busy_loop_is_stopped_by_the_cpu_limit_before_the_wall_timeout():
    result = run_program("while True:\n    pass\n", timeout=30.0, limits=ProgramLimits(cpu_seconds=1))
    assert not result.passed and result.reason in ("exit -24", "exit -9") and result.seconds < 10.0


def test_a_large_file_write_is_stopped(tmp_path):
    program = "open('big.bin', 'wb').write(bytes(8 << 20))\n"
    result = run_program(program, limits=ProgramLimits(file_bytes=1 << 20))
    assert not result.passed


def test_programs_run_isolated_in_a_temp_directory(tmp_path):
    marker = tmp_path / "cwd.txt"
    run_program(f"import os, sys\nopen({str(marker)!r}, 'w').write(os.getcwd() + '|' + str(sys.flags.isolated))\n")
    cwd, isolated = marker.read_text().split("|")
    assert "dflash2-humaneval-" in cwd and isolated == "1"


def test_the_canonical_humaneval_solutions_pass():
    references = load_references("humaneval")
    raw = {row["task_id"]: row for row in reference_rows("humaneval")}
    for task_id in ("HumanEval/0", "HumanEval/2"):
        task = references[task_id]
        assert score(task, raw[task_id]["canonical_solution"]).passed  # the body: the prompt goes first
        assert not score(task, "    return None\n").passed


def test_gsm8k_references_load_by_prompt_id():
    references = load_references("gsm8k")
    assert references["0"].answer == Decimal(18)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped earlier
    assert first_divergence([], []) is None


def test_pass_rates_summarize_per_format_and_suite():
    rows = [{"weights": "bf16", "suite": "gsm8k", "passed": True, "first_divergence": None},
            {"weights": "int4", "suite": "gsm8k", "passed": False, "first_divergence": 7},
            {"weights": "bf16", "suite": "gsm8k", "passed": False, "first_divergence": None},
            {"weights": "int4", "suite": "gsm8k", "passed": True, "first_divergence": None}]
    bf16, int4 = summarize_pass_rates(rows)
    assert (bf16.weights, bf16.passed, bf16.identical, bf16.prompts) == ("bf16", 1, 2, 2)
    assert (int4.passed, int4.identical, int4.divergences) == (1, 1, [7, None])
    table = pass_rate_table([bf16, int4], "bf16")
    assert "| int4 | gsm8k | 1/2 (50%) | 1/2 | 7, - |" in table
