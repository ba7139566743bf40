"""Tools: the calculator a trajectory may call between turns, and its adapters to the two call
formats (the tiny tool demo's "?" and Qwen's JSON `<tool_call>`).

Owns evaluating model-written (untrusted) arithmetic (Python's `ast`, never eval; bounded in size,
depth and magnitude; bad input is an "error: ..." observation, never an exception), finding the
call in a response, and formatting the observation. Does not decide when the tool runs (rollout.py
calls it on a turn that ends in a call).
"""

import ast
import json
import math
import operator

MAX_CHARS = 200  # longer input is rejected before parsing; this also bounds the AST depth
# parenthesis nesting, checked before ast.parse (which can recurse on deep nesting)
MAX_DEPTH = 20
MAX_OPERAND = 1e15  # |literal| bound: keeps int arithmetic cheap and floats exact-ish
MAX_EXPONENT = 64  # |b| bound in a ** b
MAX_RESULT = 1e30  # |value| bound on every intermediate result, so no step can blow up
# First layer: the parser never sees names, strings, escapes or null bytes. The AST check is the
# second.
ALLOWED_CHARS = frozenset("0123456789.eE_+-*/() \t\n")


class CalcError(ValueError):
    """An expression the calculator refuses; its message becomes the observation."""


# Only these operators exist for the model; everything else in Python's grammar is rejected.
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def _paren_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        deepest = max(deepest, depth)
    return deepest


def _bounded(value: int | float, limit: float, what: str) -> int | float:
    # (-8) ** 0.5 is complex in Python 3; inf/nan come from float overflow.
    if isinstance(value, complex):
        raise CalcError("complex result")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError(f"{what} is not finite")
    if abs(value) > limit:
        raise CalcError(f"{what} too large")
    return value


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a ** b before computing it if |b| or the result's size (|b| * log10|a| digits) is
    too big."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent too large (|exponent| <= {MAX_EXPONENT})")
    if base != 0 and exponent * math.log10(abs(base)) > math.log10(MAX_RESULT):
        raise CalcError("result too large")


def _eval(node: ast.AST) -> int | float:
    # Recursion depth <= AST depth, which MAX_CHARS bounds to ~MAX_CHARS levels (under Python's
    # limit).
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # type(), not isinstance: bool is an int subclass
            raise CalcError(f"unsupported constant of type {type(node.value).__name__}")
        return _bounded(node.value, MAX_OPERAND, "operand")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right), MAX_RESULT, "result")
    op = getattr(node, "op", None)  # name the operator for e.g. 5 // 2, not just "BinOp"
    raise CalcError(f"unsupported syntax: {type(op or node).__name__}")


def _format(value: int | float) -> str:
    # Integral floats print as ints ("7/1" -> "7"); others with 12 significant digits, which hides
    # binary noise (0.1+0.2 -> "0.3") yet keeps tiny values (1e-07) that rounding to decimals would
    # zero.
    if isinstance(value, float) and value.is_integer() and abs(value) < MAX_OPERAND:
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".12g")


def calculate(expression: str) -> str:
    """Evaluate `expression` (numbers, unary +/-, + - * / **, parentheses); never raises, never
    hangs."""
    if not isinstance(expression, str):
        return "error: expression must be a string"
    text = expression.strip()
    if not text:
        return "error: empty expression"
    if len(text) > MAX_CHARS:
        return f"error: expression longer than {MAX_CHARS} characters"
    bad = sorted(set(text) - ALLOWED_CHARS)
    if bad:
        return f"error: unsupported character {bad[0]!r}"
    if _paren_depth(text) > MAX_DEPTH:
        return f"error: parentheses nested deeper than {MAX_DEPTH}"
    try:
        tree = ast.parse(text, mode="eval")
        return _format(_eval(tree.body))
    except CalcError as e:
        return f"error: {e}"
    except SyntaxError:
        return "error: invalid syntax"
    except ZeroDivisionError:
        return "error: division by zero"
    except (RecursionError, MemoryError):  # the parser itself can hit these on pathological input
        return "error: expression too complex"
    except (OverflowError, ValueError) as e:  # e.g. float(int) overflow, int literal digit limit
        return f"error: {e}"


# ---------------------------------------------------------------- adapters to the call formats
class CalculatorTool:
    """Turns a response that ends in a tool call into observation tokens for the next turn.

    Called by rollout.py with the response ids and the trajectory's prompt ids; returns (observation
    ids, is_error), or None when the response makes no tool call (it is the answer). The call is
    untrusted model text: it only ever reaches calculator.calculate, which parses it and answers
    errors as text, never by raising.
    """

    def __init__(self, tokenizer, call_start, call_end, parse_call, format_observation):
        self.tokenizer = tokenizer
        self.call_start = call_start
        self.call_end = call_end
        self.call_end_id = tokenizer.convert_tokens_to_ids(call_end)  # generation stops on it
        self.parse_call = parse_call
        self.format_observation = format_observation

    def __call__(self, response_ids, prompt_ids=()):
        if not response_ids or response_ids[-1] != self.call_end_id:
            return None
        expression = self.expression(response_ids, prompt_ids)
        result = calculate(expression) if expression is not None else "error: malformed tool call"
        observation = self.format_observation(result)
        return self.tokenizer(observation, add_special_tokens=False).input_ids, result.startswith(
            "error"
        )

    def expression(self, response_ids, prompt_ids):
        """The expression the call asks for: the text between the last call_start and call_end,
        parsed."""
        text = self.tokenizer.decode(list(response_ids), skip_special_tokens=False)
        start = text.rfind(self.call_start)
        return (
            self.parse_call(text[start + len(self.call_start) : -len(self.call_end)])
            if start >= 0
            else None
        )


class QuestionCalculator(CalculatorTool):
    """The tiny tool demo's calculator: a turn that ends in "?" asks for the value of the
    question (the prompt's expression; the turn's other text is ignored); the observation is
    "=4"."""

    def __init__(self, tokenizer):
        super().__init__(
            tokenizer,
            "",
            "?",
            parse_call=None,
            format_observation=lambda result: "=?" if result.startswith("error") else f"={result}",
        )

    def expression(self, response_ids, prompt_ids):
        return self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True).removesuffix("=")


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def qwen_calculator(tokenizer):
    """Qwen2.5/Qwen3 chat-template tool calls: <tool_call>{"name": ..., "arguments":
    {...}}</tool_call>, answered as a <tool_response> in a user turn, exactly as the chat
    template renders tool messages."""

    def parse_call(call):
        try:
            return json.loads(call)["arguments"]["expression"]  # json.loads never executes anything
        except (ValueError, KeyError, TypeError):
            return None

    def format_observation(result):
        return (
            f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )

    return CalculatorTool(tokenizer, "<tool_call>", "</tool_call>", parse_call, format_observation)
