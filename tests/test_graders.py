"""Tests of the GSM8K, MATH-500 and HumanEval graders and the uniform :func:`grade` API."""

from __future__ import annotations

import threading
import time

import pytest

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation import GradeResult, Problem, grade, load_dataset
from adaptivespec.evaluation.math_answers import TimeLimitExceeded, equivalent, last_boxed, time_limit, too_big
from adaptivespec.evaluation.graders import (
    extract_code,
    extract_gsm8k_answer,
    extract_math_answer,
    grade_gsm8k,
    grade_humaneval,
    humaneval_program,
    parse_number,
)
from adaptivespec.evaluation.sandbox import run_python


def _problem(task: str, reference: str | None, **meta: object) -> Problem:
    return Problem(id="t", prompt="p", reference=reference, task=task, meta=dict(meta))


@pytest.fixture(scope="module")
def humaneval() -> list[Problem]:
    return load_dataset("humaneval", limit=3)


# ----------------------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("9 * 2 = 18.\nThe answer is 18.", "18"),
        ("The answer is 1,234.", "1,234"),
        ("It costs $5 each. The answer is $1,000.00.", "1,000.00"),
        ("The answer is: **42**", "42"),
        ("The answer is -7.", "-7"),
        ("The answer is 3/4.", "3/4"),
        ("The answer is .5", ".5"),
        ("Half of 10 is 5.\n#### 5", "5"),
        ("The answer is 7. Check: 3 + 4 = 7, and 10 - 3 = 7. #### 99", "7"),  # "answer is" first
        ("So the result is \\boxed{36}. Then 2 more", "36"),  # boxed before the last number
        ("First 12, then 10 - 5 = 5 apples", "5"),  # last number; "-" of a subtraction is no sign
        ("She has 2.50 dollars", "2.50"),
        ("The answer is $\\$1{,}200$.", "1,200"),
        ("no digits here", None),
    ],
)
def test_extract_gsm8k_answer(completion: str, expected: str | None) -> None:
    assert extract_gsm8k_answer(completion) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [("1,234", 1234), ("$1,000.00", 1000), ("12.0", 12), ("-3", -3), ("3/4", 0.75), (".5", 0.5)],
)
def test_parse_number(text: str, value: float) -> None:
    assert parse_number(text) == value


def test_parse_number_rejects_non_numbers() -> None:
    assert parse_number("twelve") is None and parse_number("1/0") is None


@pytest.mark.parametrize(
    ("completion", "gold", "correct"),
    [
        ("The answer is 1234.", "1,234", True),
        ("The answer is $1,234.00.", "1,234", True),
        ("The answer is 12.0", "12", True),
        ("The answer is 12.5", "12", False),
        ("The answer is -5.", "-5", True),
        ("The answer is 5.", "-5", False),
        ("The answer is 1,000,000", "1000000", True),
        ("The answer is 123.", "1,234", False),
        ("The answer is 6/8", "0.75", True),
    ],
)
def test_grade_gsm8k(completion: str, gold: str, correct: bool) -> None:
    result = grade_gsm8k(completion, gold)
    assert result.correct is correct
    assert result.extracted is not None and result.reason


def test_grade_gsm8k_reports_missing_number_and_bad_reference() -> None:
    assert grade_gsm8k("I do not know", "3") == GradeResult(
        correct=False, extracted=None, reason="no number found in the completion"
    )
    assert grade_gsm8k("The answer is 3", None).correct is False


def test_gsm8k_dataset_solutions_grade_correct() -> None:
    problems = load_dataset("gsm8k", limit=200)
    assert all(grade(p, p.meta["solution"]).correct for p in problems)
    assert not any(grade(p, "The answer is 0.123456").correct for p in problems)


# -------------------------------------------------------------------------------------- MATH-500


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
         "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\boxed{\\{1,\\frac{2}{3}\\}}", "\\{1,\\frac{2}{3}\\}"),
        ("\\fbox{x^{2}}", "x^{2}"),
        ("\\boxed 5.", "5"),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("no box", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_extract_math_answer_falls_back_to_answer_is() -> None:
    assert extract_math_answer("Thus the answer is $\\frac{3}{4}$.") == "\\frac{3}{4}"
    assert extract_math_answer("The final answer is 12.") == "12"
    assert extract_math_answer("I am not sure") is None


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{1}{2}", "\\frac12"),
        ("\\tfrac 59", "\\frac{5}{9}"),
        ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"),
        ("\\frac{\\sqrt2}{2}", "\\frac{1}{\\sqrt{2}}"),
        ("90", "90^\\circ"),
        ("90^{\\circ}", "90"),
        ("10080", "10,\\!080"),
        ("32348", "\\$32,\\!348"),
        ("\\frac{270}{7}", "\\frac{270}7\\text{ degrees}"),
        ("15", "15\\mbox{ cm}^2"),
        ("1.8", "1\\frac{4}{5}"),
        ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("-2, 1", "1,-2"),
        ("1+\\sqrt{19}, 1-\\sqrt{19}", "1 \\pm \\sqrt{19}"),
        ("\\{-2, 1-\\sqrt5, 1+\\sqrt5\\}", "\\{1\\pm\\sqrt{5},-2\\}"),
        ("(-\\infty,0]", "\\left(-\\infty, 0\\right]"),
        ("(0,9)\\cup(9,36)", "(0,9) \\cup (9,36)"),
        ("[-2,7]", "x \\in [-2,7]"),
        ("5", "x = 5"),
        (
            "\\begin{bmatrix} 0.2 \\\\ -3.6 \\end{bmatrix}",
            "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}",
        ),
        ("-5x + 7y - 11z - 4 = 0", "5x - 7y + 11z + 4 = 0"),
        ("ab + 2a + 5b + 10", "(a+5)(b+2)"),
        ("-5i + 6", "6 - 5i"),
        ("\\sqrt{117}", "3\\sqrt{13}"),
        ("\\frac{\\cos x}{\\sin x}", "\\cot x"),
        ("C", "\\text{(C)}"),
        ("evelyn", "\\text{Evelyn}"),
        ("52_8", "52_{8}"),
        ("10\\%", "10"),
        ("2.50", "\\frac{5}{2}"),
        ("\\frac{3}{2}.", "1.5"),
    ],
)
def test_equivalent_true(prediction: str, gold: str) -> None:
    assert equivalent(prediction, gold)


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [
        ("0.33", "\\frac{1}{3}"),
        ("\\frac{1}{3}", "\\frac{1}{2}"),
        ("2", "3"),
        ("(1,2)", "[1,2]"),
        ("(-\\infty,0)", "(-\\infty, 0]"),
        ("(2,1)", "(1,2)"),
        ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}"),
        ("ab + 2a + 5b", "(a+5)(b+2)"),
        ("42_8", "52_8"),
        ("6 + 5i", "6 - 5i"),
        ("\\text{odd}", "\\text{even}"),
        ("", "1"),
        ("\\frac{", "1"),
        ("}{)(", "1"),
    ],
)
def test_equivalent_false(prediction: str, gold: str) -> None:
    assert not equivalent(prediction, gold)


@pytest.mark.parametrize(("prediction", "gold"), [
    ("(3, \\dfrac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("11111111100", "11,\\! 111,\\! 111,\\! 100"),
    ("1000", "\\$1,000.00"),
    ("5.4", "5.4 \\text{ cents}"),
])
def test_equivalent_tricky_forms(prediction: str, gold: str) -> None:
    assert equivalent(prediction, gold)


def test_too_big_spots_uninterruptible_evaluations() -> None:
    for huge in ("2^{10^{10}}", "3^{200000}", "9^{9^{9^{9}}}", "20000!", "2^ {(10^{10})}"):
        assert too_big(huge), huge
    for fine in ("2^{10}", "e^{x^2}", "e^{t^2}", "100!", "x^{n+1}", "10^{-3}", "\\frac{1}{2}"):
        assert not too_big(fine), fine


def test_huge_and_malicious_inputs_are_refused_quickly() -> None:
    start = time.monotonic()
    assert not equivalent("2^{10^{10}}", "3")
    assert not equivalent("100000!", "3")
    assert not equivalent("9^{9^{9^{9}}}", "9^{9^{9^{9}}} + 1")
    assert time.monotonic() - start < 3
    assert not equivalent("__import__('os').system('true')", "0")


def test_time_limit_interrupts_in_main_thread() -> None:
    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded), time_limit(0.2):
        while True:
            pass
    assert time.monotonic() - start < 2


def test_equivalent_works_off_the_main_thread() -> None:
    results: list[bool] = []
    def work() -> None:
        results.append(equivalent("\\dfrac{\\sqrt2}{2}", "\\frac{1}{\\sqrt{2}}"))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(30)
    assert results == [True]


def test_grade_math_results() -> None:
    problem = _problem("math500", "\\frac{14}{3}")
    right = grade(problem, "So we get $\\boxed{\\dfrac{14}{3}}$.")
    assert right.correct is True and right.extracted == "\\dfrac{14}{3}"
    wrong = grade(problem, "So we get $\\boxed{\\frac{3}{14}}$.")
    assert wrong.correct is False and wrong.extracted == "\\frac{3}{14}"
    missing = grade(problem, "It is fourteen thirds")
    assert missing.correct is False and missing.extracted is None and "boxed" in missing.reason


def test_math500_dataset_solutions_grade_correct() -> None:
    problems = load_dataset("math500")
    assert all(grade(p, p.meta["solution"]).correct for p in problems)
    # and a wrong answer fails for every problem: the gold answer plus one
    assert not any(grade(p, f"So the answer is $\\boxed{{{p.reference} + 1}}$.").correct for p in problems)


# ------------------------------------------------------------------------------------- HumanEval


def test_canonical_solution_passes(humaneval: list[Problem]) -> None:
    problem = humaneval[0]
    assert problem.id == "HumanEval/0"
    result = grade(problem, problem.meta["canonical_solution"])
    solution = problem.meta["canonical_solution"]
    assert result == GradeResult(correct=True, extracted=solution, reason="passed")


def test_fenced_full_function_passes(humaneval: list[Problem]) -> None:
    problem = humaneval[0]
    completion = (
        "Sure! Here it is:\n```python\ndef has_close_elements(numbers, threshold):\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)\n"
        "               for j, b in enumerate(numbers) if i != j)\n```\nThis is O(n^2)."
    )
    assert grade(problem, completion).correct is True


def test_unindented_body_is_indented(humaneval: list[Problem]) -> None:
    problem = humaneval[2]  # truncate_number
    assert grade(problem, "```\nreturn number % 1.0\n```").correct is True


def test_wrong_solution_fails(humaneval: list[Problem]) -> None:
    result = grade(humaneval[0], "    return False\n")
    assert result.correct is False and "AssertionError" in result.reason


def test_crashing_solution_fails(humaneval: list[Problem]) -> None:
    result = grade(humaneval[0], "    raise RuntimeError('boom')\n")
    assert result.correct is False and "RuntimeError: boom" in result.reason
    assert grade(humaneval[0], "    return (\n").correct is False  # syntax error


def test_infinite_loop_times_out(humaneval: list[Problem]) -> None:
    start = time.monotonic()
    result = grade_humaneval(humaneval[0], "    while True:\n        pass\n", timeout=1.0)
    assert result.correct is False and "timed out" in result.reason
    assert time.monotonic() - start < 5


def test_early_exit_is_not_a_pass(humaneval: list[Problem]) -> None:
    for body in ("    import sys; sys.exit(0)\n", "    import os; os._exit(0)\n"):
        assert grade(humaneval[0], body).correct is False


def test_extract_code_prefers_block_defining_entry_point() -> None:
    completion = (
        "```bash\npip install x\n```\n```python\nimport math\n```\n"
        "```python\ndef f(x):\n    return x\n```"
    )
    assert extract_code(completion, "f") == "def f(x):\n    return x\n"
    assert extract_code("```python\ndef g():\n    pass", "f") == "def g():\n    pass"  # unclosed
    assert extract_code("    return 1\n", "f") == "    return 1\n"


def test_humaneval_program_keeps_prompt_helpers() -> None:
    prompt = "import math\n\ndef helper(x):\n    return x\n\ndef f(x):\n    '''doc'''\n"
    completion = "```python\ndef f(x):\n    return helper(x)\n```"
    program = humaneval_program(prompt, completion, "def check(c):\n    assert c(2) == 2\n", "f")
    assert program.startswith(prompt) and program.rstrip().endswith("check(f)")
    assert run_python(program, timeout=10).ok


def test_sandbox_limits() -> None:
    memory = run_python("x = bytearray(4 * 1024 ** 3)\n", memory_mb=512)
    assert not memory.ok and "MemoryError" in memory.reason
    assert not run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))\n").ok
    cwd_check = "import os, tempfile\nassert os.getcwd() == os.path.realpath(tempfile.gettempdir())"
    cwd = run_python(cwd_check)
    assert cwd.ok, cwd.reason
    assert run_python("import sys\nassert sys.stdin.read() == ''\nassert sys.flags.isolated\n").ok


# ------------------------------------------------------------------------------------------- API


@pytest.mark.parametrize("task", ["specbench", "mtbench"])
def test_ungraded_tasks(task: str) -> None:
    result = grade(_problem(task, "anything"), "some reply")
    assert result.correct is None and result.extracted is None and task in result.reason


def test_unknown_task_is_an_error() -> None:
    with pytest.raises(AdaptiveSpecError, match="no grader for task 'poetry'"):
        grade(_problem("poetry", None), "roses")
