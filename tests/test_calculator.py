"""Tests for tools.py's calculator: correct arithmetic, error observations, and bounded time on
hostile input.

Covers calculator() only; tool-call parsing and the multi-turn loop are tested elsewhere.
"""

import ast
import random
import time

import pytest

from task.tools import CalcError, _eval, calculator


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("2+3*4", "14"),
        ("(1+2)**3", "27"),
        ("7/2", "3.5"),
        ("-3--2", "-1"),
        ("+5", "5"),
        ("1.5*4", "6"),  # integral float prints as an int
        ("0.1+0.2", "0.3"),  # binary noise hidden
        ("2.5-0.25", "2.25"),
        ("1/3", "0.333333333333333"),
        ("0.5+123456789012", "123456789012.5"),  # 15 digits: 12 rounded this to an integer
        ("1.1*1.1", "1.21"),
        ("2**-1", "0.5"),
        ("2**0.5", "1.4142135623731"),
        ("1e-7", "1e-07"),  # small values are kept, not rounded to 0
        (" 10 ** 15 ", "1000000000000000"),
        ("1e15+1", "1000000000000001"),  # an integral literal computes as an int: exact
        ("71e13*8.2", "5.822e+15"),  # a float result past 1e15: its binary noise still hidden
        ("12e12/11e-3", "1.09090909090909e+15"),
        ("-(2*(3+4))", "-14"),
    ],
)
def test_correct_results(expression, expected):
    """Arithmetic comes back as exact text: an integral float prints as an int, binary noise is
    rounded away, small values are kept."""
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("", "empty"),
        ("1/0", "division by zero"),
        ("0**-1", "division by zero"),
        ("(-8)**0.5", "complex"),
        ("9**9**9**9", "exponent"),
        ("2**100000", "exponent"),
        ("10**40", "too large"),
        ("1e308*1e308", "operand"),
        ("1e15*1e15*10", "too large"),
        ("1" * 10000, "longer than"),
        ("(" * 10000 + "1" + ")" * 10000, "longer than"),
        ("(" * 30 + "1" + ")" * 30, "nested"),
        ("__import__('os').system('ls')", "unsupported character"),
        ("a", "unsupported character"),
        ("lambda: 1", "unsupported character"),
        ("(1).real", "unsupported character"),
        ("True+1", "unsupported character"),
        ("1j", "unsupported character"),
        ("'a'*3", "unsupported character"),
        ("e", "unsupported syntax: Name"),  # allowed characters, rejected by the AST check
        ("1e", "syntax"),
        ("5//2", "FloorDiv"),
        ("2+", "syntax"),
        ("1\x002", "unsupported character"),
    ],
)
def test_errors_are_observations(expression, reason):
    """Bad input (empty, division by zero, huge exponents or results, deep nesting, names, calls,
    attributes, other syntax) returns an "error: ..." text naming the reason; it never raises."""
    result = calculator(expression)
    assert result.startswith("error: ") and reason in result, result


def test_non_string_input():
    """A non-string expression (None) is an error observation, not an exception."""
    assert calculator(None).startswith("error: ")


@pytest.mark.parametrize("source", ["True", "1j", "'a'", "x", "f(1)", "[1]", "1 if 1 else 2"])
def test_ast_layer_rejects_non_arithmetic(source):
    """The AST check on its own (the character filter in front of it already stops these) rejects
    booleans, complex numbers, strings, names, calls, lists and conditionals with a CalcError."""
    with pytest.raises(CalcError):
        _eval(ast.parse(source, mode="eval").body)


def _timed(expression) -> tuple[str, float]:
    start = time.perf_counter()
    result = calculator(expression)
    return result, time.perf_counter() - start


def test_fuzz_never_raises_and_is_fast():
    """Hostile cases and 5,000 random expressions (70% over the allowed characters): every call
    returns a string, and none takes 0.1 s or more."""
    rng = random.Random(0)
    allowed = "0123456789+-*/(). e"
    hostile = "*()_'\"[]{}:;,.\\\x00abcjxlmd=<>!~%&|@#$^` \n\t"
    cases = [
        "9**9**9**9",
        "2**100000",
        "(" * 10000 + "1" + ")" * 10000,
        "1" * 10000,
        "__import__('os').system('ls')",
        "a",
        "1e308*1e308",
        "lambda: 0",
        "().__class__",
        "x" * 100_000,
        "-" * 199 + "1",
        "+-" * 99 + "1",
        "1+" * 99 + "1",
        "9**" * 60 + "9",
        "(((((((((((((((((((9**9)**9)**9)**9)**9)**9)**9)**9)**9)"
        "**9)**9)**9)**9)**9)**9)**9)**9)**9)",
        "[" * 199,
        "{" * 199,
        "0." + "9" * 190,
    ]
    for _ in range(5000):
        alphabet = allowed if rng.random() < 0.7 else allowed + hostile
        cases.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 250))))
    slowest = 0.0
    for expression in cases:
        result, seconds = _timed(expression)
        assert isinstance(result, str), (expression, result)
        slowest = max(slowest, seconds)
    assert slowest < 0.1, f"slowest call took {slowest:.3f}s"
