"""Tools a trajectory may call between turns: plain Python functions, and the two call formats
that reach them (Qwen's JSON `<tool_call>`, and the tiny tool demo's "?").

Owns turning a response that ends in a call into the observation of the next turn: finding the
call, parsing it (model-written, untrusted: `json.loads`, never `eval`), checking its arguments
against the function's JSON schema (built from its type hints and docstring by transformers'
`get_json_schema`, the schema the chat template shows the model), running it off the event loop
within `rollout.tool_timeout_s`, and formatting its result or the error. Also the built-in tool,
the calculator (Python's `ast`, bounded in size, depth and magnitude). And the loop of a
multi-turn trajectory (`multi_turn`): generate, call, observe, go on, each turn sent and each call
run through the rollout in flight (inflight.py), which owns waiting and aborting.
"""

import array
import ast
import asyncio
import inspect
import json
import math
import operator
import re
import time
import types
import typing

import jsonschema
from transformers.utils.chat_template_utils import (
    DocstringParsingException,
    TypeHintParsingException,
    get_json_schema,
)

from config import ConfigError, load_function
from runtime.threads import DaemonPool

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
        value = _bounded(node.value, MAX_OPERAND, "operand")
        # an integral literal (1e15, 3.0) computes as the int it is: exact where a float result
        # past 1e15 would print rounded ("1e15+1" read "1e+15")
        return int(value) if isinstance(value, float) and value.is_integer() else value
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
    # Integral floats print as ints ("7/1" -> "7"); others with 15 significant digits (a float's
    # decimal precision), which hides binary noise (0.1+0.2 -> "0.3") yet keeps tiny values (1e-07)
    # that rounding to decimals would zero. 12 rounded 0.5+123456789012 to "123456789012".
    if isinstance(value, float) and value.is_integer() and abs(value) < MAX_OPERAND:
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".15g")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / ** and parentheses.

    Args:
        expression: The expression, for example "12*3+4".
    """
    # The docstring above is what the model reads (the tool's schema). For us: never raises (a
    # refusal is an "error: ..." result), never hangs.
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


# ---------------------------------------------------------------- your own tools
UNPARSED = "unparsed"  # the per-tool count of calls with no well-formed JSON or an unknown name


class Observation(typing.NamedTuple):
    """What a tool call gave the next turn."""

    ids: list  # the observation's token ids
    tool: str  # the tool called (UNPARSED: none could be read)
    is_error: bool
    # the tool ran (the call was read, named a tool, and its arguments fit the schema), whatever
    # it returned: the model made a well-formed call, even where the tool then failed. None (a
    # task's own tool that does not say): it ran unless is_error
    ran: bool | None = None


def function_schema(fn):
    """The JSON schema the chat template lists for `fn`, from its type hints and its Google-style
    docstring (transformers.utils.get_json_schema, as TRL builds its tools' schemas). A function
    it cannot describe is a ConfigError naming what is missing, and so is one it would describe
    wrongly (`describable`)."""
    name = getattr(fn, "__name__", fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 - a hint naming what is not importable here
        raise ConfigError(f"rollout.tools: {name!r}: its type hints cannot be read: {e}") from None
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise ConfigError(
                f"rollout.tools: {name!r} takes {parameter} ({parameter.kind.description}): a "
                "call passes named arguments, each listed in its schema"
            )
        hint = hints.get(parameter.name)
        if hint is not None and not describable(hint):
            raise ConfigError(
                f"rollout.tools: {name}({parameter.name}: {hint}): that type has no JSON schema "
                "(str, int, float, bool, None, Any, Literal, and lists, tuples, dicts and unions "
                "of them); the model would be shown an object and the tool handed a dict"
            )
    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise ConfigError(
            f"rollout.tools: cannot build a schema for {name!r}: {e} "
            "(a tool needs a type hint on each argument and a docstring with an Args: section, "
            "an argument a line as `name: what it is`)"
        ) from None


# what transformers' get_json_schema describes as itself (utils/chat_template_utils.py,
# _get_json_schema_type): any other class (an Enum, a dataclass, a date) it calls an "object"
PLAIN_TYPES = (str, int, float, bool, type(None), list, tuple, dict, typing.Any)


def describable(hint):
    """Whether get_json_schema describes type hint `hint` as the value a call must pass: a plain
    type, a Literal, or a list, tuple, dict or union of describable ones."""
    origin = typing.get_origin(hint)
    if origin is None:
        return hint in PLAIN_TYPES
    if origin is typing.Literal:
        return True
    if origin not in (list, tuple, dict, typing.Union, types.UnionType):
        return False
    return all(describable(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)


# JSON Schema counts 3.0 as an integer; a Python `int` parameter must not get a float
STRICT_INTEGERS = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda checker, value: isinstance(value, int) and not isinstance(value, bool)
    ),
)


def arguments_schema(schema):
    """The schema a call's arguments must meet: the function's parameters, no other key allowed,
    and get_json_schema's `nullable` (OpenAPI's word) as JSON Schema's "null" type, at any depth
    (list[int | None]'s items too)."""
    parameters = with_null_types(schema["function"]["parameters"])
    return {**parameters, "additionalProperties": False}


def with_null_types(spec):
    """`spec` (a JSON schema, or a part of one) with every `nullable: true` turned into a null
    each of its constraints takes: a "null" among its types, None among its `enum`
    (Optional[Literal["cm", "in"]]), a null schema among its `anyOf` (Optional[list[int] | str],
    which has no types): a reviewer found the last two refusing a null the function takes."""
    if isinstance(spec, list):
        return [with_null_types(item) for item in spec]
    if not isinstance(spec, dict):
        return spec
    spec = {key: with_null_types(value) for key, value in spec.items()}
    # (a `properties` map is a dict too: a parameter named "nullable" is a spec, never True)
    if spec.get("nullable") is True:
        del spec["nullable"]
        if "type" in spec:
            types = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
            spec["type"] = [*types, "null"]
        if "enum" in spec:
            spec["enum"] = [*spec["enum"], None]
        if "anyOf" in spec:
            spec["anyOf"] = [*spec["anyOf"], {"type": "null"}]
    return spec


def not_json(constant):
    """json.loads's `parse_constant`: NaN, Infinity and -Infinity are Python's extensions of
    JSON, not JSON."""
    raise ValueError(f"{constant} is not JSON")


def finite_float(text):
    """json.loads's `parse_float`: a number too large for a float (1e999) would be inf."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a float")
    return value


def result_text(result):
    """A tool's return value as the observation's text: a string as is, else JSON."""
    return result if isinstance(result, str) else json.dumps(result, default=str)


def cut(text, max_chars):
    """An observation's text cut to its first `max_chars` characters (rollout.max_observation_chars)
    and a visible marker, " ... (cut)", after them: it shares the trajectory's token budget."""
    if len(text) > max_chars:
        text = text[:max_chars] + " ... (cut)"
    return text


def load_tools(specs):
    """The functions `rollout.tools` names (config.load_function), each with a schema; none
    named: the calculator. Two of one name is a ConfigError (the model calls a tool by name)."""
    functions = [load_function(spec, "rollout.tools") for spec in specs] or [calculator]
    for spec, fn in zip(specs, functions):
        if not inspect.isfunction(fn):  # a partial or a callable object has no name, no schema
            raise ConfigError(f"rollout.tools: {spec!r} is not a plain or async def function")
    names = [fn.__name__ for fn in functions]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"rollout.tools={specs}: two tools named {twice[0]!r}")
    if UNPARSED in names:
        raise ConfigError(f"rollout.tools: {UNPARSED!r} names the count of unreadable calls")
    for fn in functions:
        function_schema(fn)  # a function the schema cannot describe fails here, named
    return functions


def added_tokens(tokenizer):
    """A pattern matching every added token's spelling (Qwen's <|im_end|>, <tool_response>, ...),
    longest first: the strings a tokenizer turns into control tokens wherever they appear."""
    spellings = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, spellings))) if spellings else None


def text_ids(tokenizer, text, markers):
    """Token ids of `text` read as plain text: an added token's spelling inside it is encoded as
    the characters it is made of (its first character, then the rest), never as the token
    itself (one a single character long excepted: none of the chat template's is), and decodes
    back to the text (as the tokenizer normalises it: NFC for Qwen's). transformers'
    `split_special_tokens` would do this for special tokens only, and Qwen's <tool_response> and
    <tool_call> are added, not special."""
    ids = []
    start = 0
    for found in markers.finditer(text) if markers else ():
        ids += tokenizer(text[start : found.start()], add_special_tokens=False).input_ids
        spelled = found.group()
        ids += tokenizer(spelled[0], add_special_tokens=False).input_ids
        ids += text_ids(tokenizer, spelled[1:], markers)  # shorter: it may hold another marker
        start = found.end()
    return ids + tokenizer(text[start:], add_special_tokens=False).input_ids


QWEN_OPENING = "<|im_start|>assistant\n"  # how Qwen's template opens an assistant turn


def assistant_opening(tokenizer, template_kwargs=None):
    """How the tokenizer's chat template opens an assistant turn under `template_kwargs`
    (data.chat_template_kwargs): its generation prompt, the text add_generation_prompt adds.
    Qwen3's with enable_thinking false is QWEN_OPENING and an empty think block, which every turn
    after an observation must open with too, or the model thinks again from its second turn. A
    template without one, or not Qwen's, gets QWEN_OPENING (QwenTools' format)."""
    if not getattr(tokenizer, "chat_template", None):
        return QWEN_OPENING
    messages = [{"role": "user", "content": "?"}]
    rendered = [
        tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt, **(template_kwargs or {})
        )
        for prompt in (False, True)
    ]
    opening = rendered[1][len(rendered[0]) :]
    return opening if opening.startswith(QWEN_OPENING) else QWEN_OPENING


class Exited(Exception):
    """An async tool's SystemExit, carried out of its task as an ordinary exception: a task whose
    coroutine raises SystemExit re-raises it out of the event loop (asyncio/tasks.py, __step), so
    no await of the task would see it."""


async def exit_as_error(coroutine):
    """`coroutine`'s result, its SystemExit raised as Exited."""
    try:
        return await coroutine
    except SystemExit as e:
        raise Exited from e


class QwenTools:
    """Tool calls in the Qwen2.5/Qwen3 chat template's format: the model writes
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>, and the observation is a
    <tool_response> in a user turn, exactly as the template renders a tool message.

    A call is answered with an error observation, counted as an error of its tool, when its JSON
    does not parse, it names no tool given, the schema refuses its arguments (missing, extra or of
    a wrong type), the tool raises, returns text that starts with "error" (the calculator's
    refusals), or runs past `timeout_s`. A plain function runs in a thread pool of its own
    (`workers` threads), so the rollout's event loop and cancel decisions go on meanwhile (a
    thread cannot be stopped: one past its time limit finishes in the background, its result
    dropped); an `async def` one is awaited on the loop, so it must await, never block. Each
    observation ends by opening the next assistant turn as the template does (`opening`:
    assistant_opening).
    """

    call_start = "<tool_call>"
    call_end = "</tool_call>"

    def __init__(
        self, tokenizer, functions, timeout_s=10.0, workers=4, max_chars=2000, opening=QWEN_OPENING
    ):
        self.tokenizer = tokenizer
        self.opening = opening
        self.call_end_id = tokenizer.convert_tokens_to_ids(self.call_end)  # generation stops here
        if self.call_end_id in (None, tokenizer.unk_token_id):
            raise ConfigError(
                f"tools: the tokenizer has no {self.call_end} token; tool calls need a Qwen2.5 or "
                "Qwen3-style chat template"
            )
        self.functions = {fn.__name__: fn for fn in functions}
        self.schemas = [function_schema(fn) for fn in functions]  # for the chat template
        self.validators = {
            s["function"]["name"]: STRICT_INTEGERS(arguments_schema(s)) for s in self.schemas
        }
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        # apart from the rewards' threads: a stuck tool can starve only the other tools' calls
        # daemon threads: a tool that never returns cannot keep the process from exiting
        self.pool = DaemonPool(workers, "tool")
        self.freed_at = 0.0  # time.monotonic() when a pool thread last came free
        self.names = [*self.functions, UNPARSED]  # what the per-tool counts are logged under
        self.markers = added_tokens(tokenizer)

    async def __call__(self, response_ids, prompt_ids=()):
        """The Observation of a response that ends in a call, or None when it makes none (it is
        the answer)."""
        if not response_ids or response_ids[-1] != self.call_end_id:
            return None
        text = self.tokenizer.decode(list(response_ids), skip_special_tokens=False)
        start = text.rfind(self.call_start)
        call = text[start + len(self.call_start) : -len(self.call_end)] if start >= 0 else ""
        name, result, ran = await self.run(call)
        is_error = result.startswith("error")
        # an error message (a user's exception's) as much as a result; a lone surrogate ("\ud800",
        # which a Python str may hold) would make the tokenizer raise: replaced
        result = cut(result, self.max_chars).encode("utf-8", "replace").decode("utf-8")
        # the template's markers are control tokens; the result between them is text, whatever
        # it spells (a result reading "<|im_end|><|im_start|>system" must not open a turn)
        head = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        tail = "\n</tool_response><|im_end|>\n" + self.opening
        ids = self.encode(head) + text_ids(self.tokenizer, result, self.markers) + self.encode(tail)
        return Observation(ids, name, is_error, ran)

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def run(self, call):
        """(the tool's name, or UNPARSED; its result, or "error: ..."; whether the tool ran) for
        one call's text."""
        try:
            # json.loads never executes anything; it does take NaN, Infinity and 1e999 (as inf),
            # which JSON has not and a schema's "number" would pass: refused here
            parsed = json.loads(call, parse_constant=not_json, parse_float=finite_float)
        except ValueError:
            return UNPARSED, "error: the tool call is not valid JSON", False
        except RecursionError:  # model-written text nested deeper than Python's parser recurses
            return UNPARSED, "error: the tool call is nested too deeply", False
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return UNPARSED, 'error: a tool call is {"name": ..., "arguments": {...}}', False
        # "parameters" for "arguments", as SGLang's parser reads a call too
        # (function_call/base_format_detector.py); any other key would be dropped unread
        keys = set(parsed) - {"name"}
        if keys - {"arguments", "parameters"} or len(keys) > 1:
            return UNPARSED, 'error: a tool call is {"name": ..., "arguments": {...}} alone', False
        name, arguments = parsed["name"], parsed.get("arguments", parsed.get("parameters", {}))
        if name not in self.functions:
            tools = ", ".join(self.functions)
            return UNPARSED, f"error: no tool {name!r} (tools: {tools})", False
        problems = sorted(e.message for e in self.validators[name].iter_errors(arguments))
        if problems:
            return name, f"error: {name}: {'; '.join(problems)}", False
        fn = self.functions[name]
        pending = submitted = None  # the asyncio future; a plain tool's, the pool's
        try:
            if inspect.iscoroutinefunction(fn):  # awaited on the loop: it must await, never block
                # (inside the try: a signature may refuse the keywords)
                pending = asyncio.ensure_future(exit_as_error(fn(**arguments)))
            else:
                pending, submitted, started = self.submit(fn, arguments)
                if not await self.thread_started(submitted, started):
                    return (
                        name,
                        f"error: {name} found no free thread within {self.timeout_s:g} s",
                        True,
                    )
            # timed from its start; asyncio.wait, not wait_for: a tool's own TimeoutError
            # (socket.timeout is one) is an exception it raised, not the time limit
            done, _ = await asyncio.wait({pending}, timeout=self.timeout_s)
            if not done:
                return name, f"error: {name} did not return within {self.timeout_s:g} s", True
            return name, result_text(pending.result()), True
        # the user's function: an observation, never a crash; SystemExit too (sys.exit() in code
        # it runs, argparse on a bad argument: it ended the run with no checkpoint, exit code 0
        # for exit()), and its own CancelledError (a BaseException that would end the whole
        # rollout): only this task's cancellation goes on
        except (Exception, SystemExit, asyncio.CancelledError) as e:  # noqa: BLE001
            if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise
            e = e.__cause__ if isinstance(e, Exited) else e
            return name, f"error: {name} raised {type(e).__name__}: {e}", True
        finally:
            if pending is not None and not pending.done():
                pending.cancel()  # a queued call never starts; a running thread finishes unread
            # given up on while it runs (its time limit, or the trajectory cancelled: a hung tool
            # is the tail a cancellation cuts): its thread may never come back, another takes its
            # place (DaemonPool.abandon), and a call queued behind it counts that as a thread
            # come free
            if submitted is not None and not submitted.done() and self.pool.abandon(submitted):
                self.freed_at = time.monotonic()

    def submit(self, fn, arguments):
        """fn(**arguments) queued for a thread of the pool: (its asyncio future, the pool's, the
        Event set when a thread starts it). Its result's JSON is made in the thread too (a huge
        one would stall the event loop)."""
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def call():
            loop.call_soon_threadsafe(started.set)
            return result_text(fn(**arguments))

        future = self.pool.submit(call)
        future.add_done_callback(self.thread_freed)
        return asyncio.wrap_future(future), future, started

    def thread_freed(self, future):
        """When a pool thread last came free: its call ended (a queued call cancelled frees none,
        nor does one whose thread was written off and replaced: that thread ends)."""
        if not future.cancelled() and not self.pool.was_replaced(future):
            self.freed_at = time.monotonic()

    async def thread_started(self, call, started):
        """Whether a thread started the queued `call` (the pool's future). A call waits behind
        those ahead of it (more in flight than rollout.tool_workers) untimed while threads come
        free; once none has for timeout_s (every thread busy that long; one whose call passed
        its limit is replaced: `DaemonPool.abandon`), it gives up, unless a thread took it just
        then (it cannot be cancelled: it runs, and is timed)."""
        queued_at = time.monotonic()
        # asyncio.wait, not wait_for: Python 3.11's wait_for returns the result of a wait that
        # ended as it was cancelled, swallowing the cancellation (asyncio/tasks.py, wait_for)
        waiting = asyncio.ensure_future(started.wait())
        try:
            while not started.is_set():
                left = max(self.freed_at, queued_at) + self.timeout_s - time.monotonic()
                if left <= 0:
                    return not call.cancel()  # False: cancelled, it never runs
                # (on a timeout a thread may have come free meanwhile: the time left is counted
                # again)
                await asyncio.wait({waiting}, timeout=left)
            return True
        finally:
            waiting.cancel()


class QuestionCalculator:
    """The tiny tool demo's calculator: a turn that ends in "?" asks for the value of the
    question (the prompt's expression; the turn's other text is ignored); the observation is
    "=4", or "=?" when the calculator refuses."""

    call_end = "?"
    names = ["calculator"]

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.call_end_id = tokenizer.convert_tokens_to_ids(self.call_end)

    async def __call__(self, response_ids, prompt_ids=()):
        if not response_ids or response_ids[-1] != self.call_end_id:
            return None
        question = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
        result = calculator(question.removesuffix("="))
        is_error = result.startswith("error")
        ids = self.tokenizer("=?" if is_error else f"={result}", add_special_tokens=False).input_ids
        return Observation(ids, "calculator", is_error, ran=True)  # "?" is always a call


# ---------------------------------------------------------------- a multi-turn trajectory
async def multi_turn(flight, request, settings):
    """The turns of one multi-turn trajectory: generate, run the tool on a turn ending in a call,
    append its observation, go on, within `settings.max_turns` turns and `settings.budget`
    generated + observation tokens. Each turn's prompt is the previous prompt + response +
    observation, so turns merge (merge.py). `flight` is the rollout in flight
    (inflight.Rollout): it sends each turn (`generate_one`), runs each call (`run_tool`), and
    says which trajectories were cancelled (`cancelled`), so a cancellation stops a trajectory
    between turns too."""
    turns = []
    prompt_ids = request.prompt_ids
    context = array.array("i", prompt_ids)
    for turn in range(settings.max_turns):
        # cancelled before its first request, or while its tool ran
        if request.index in flight.cancelled:
            if not turns:
                return [flight.failed(request, reason="abort")]
            turns[-1].finish_reason = "abort"  # unfinished
            break
        remaining = settings.budget - (len(context) - len(prompt_ids))
        if remaining <= 0:  # token budget spent on earlier turns and observations
            # the tool ran, but no budget is left for a turn that reads it: truncated
            turns[-1].finish_reason = "length"
            break
        max_new_tokens = min(settings.sampling["max_new_tokens"], remaining)
        sampling = {**settings.sampling, "max_new_tokens": max_new_tokens}
        sample = await flight.generate_one(request, context, sampling, turn)
        turns.append(sample)
        ends_in_call = sample.finish_reason == "stop" and sample.response_ids[-1:].tolist() == [
            settings.tool.call_end_id
        ]
        if not ends_in_call:
            break  # an answer, a length cut, an abort or an error ends the trajectory
        if turn == settings.max_turns - 1:
            # a call with no turn left to read the result: truncated, not an answer
            sample.finish_reason = "length"
            break
        if request.index in flight.cancelled:
            # cancelled while this turn returned: no tool starts (the abort, which counts this
            # trajectory as generating until it reaches a tool or ends, would wait the tool out)
            sample.finish_reason = "abort"
            break
        observation = await flight.run_tool(request, sample)
        if observation is None:  # cancelled while its tool ran: not waited for, ends here
            sample.finish_reason = "abort"
            break
        ran = observation.ran if observation.ran is not None else not observation.is_error
        sample.tool_call = 1 if ran else -1
        # a new array, not +=: the turn just generated keeps `context` as its prompt_ids
        context = context + sample.response_ids + array.array("i", observation.ids)
    if any(t.masked or t.finish_reason == "abort" for t in turns):
        for t in turns:  # a trajectory is trained whole or not at all
            t.masked = True
    return turns
