"""Rewards: GSM8K's reward, loading your own (`data.reward`), calling one safely, and
`Rewards.for_rollout`, the one place a trajectory's text becomes a reward (the task's score; DAPO's
overlong penalty shapes the advantage only: advantages.py).

Owns what a reward function is called with and what it may return (a finite number; anything else
is a RewardError, counted by the rollout), and that it runs off the rollout's event loop: an
`async def` reward is awaited, a plain one runs in a thread pool of its own
(`rollout.reward_workers`), so a slow reward (a parser, a sandbox, a judge) never delays the other
requests or the cancel decision. Does not own prompts, data or a task's own reward (task/), nor
when a trajectory is scored (inflight.with_reward scores each one as it finishes).
"""

import asyncio
import decimal
import functools
import inspect
import math
import numbers
import re

import numpy

from config import ConfigError, load_function, shown
from runtime.threads import DaemonPool


class RewardError(ValueError):
    """A reward function raised, or returned something other than a finite number (the trajectory
    fails)."""


class Rewards:
    """A run's reward step: its `reward_fn` (response_text, answer, finished) -> float, the one
    `data.reward` names or else the task's own (task.data.task_reward), run in a thread pool of
    its own. `task_reward` scores one trajectory; `for_rollout` is what a rollout calls."""

    def __init__(self, reward_fn, tokenizer, cfg, tool=None):
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.cfg = cfg  # the run's Config
        # a trajectory that ends in a call no turn read (the task's tool) has no answer
        self.call_end_id = tool.call_end_id if tool is not None else None
        # plain reward functions run here, so the event loop that waits on the requests and
        # decides the cancellation never waits on one
        # (daemon threads: a reward that never returns cannot keep the process from exiting)
        self.pool = DaemonPool(cfg.rollout.reward_workers, "reward")

    def for_rollout(self, prompts_by_group):
        """The reward step, as the rollout calls it on each finished trajectory (its turns): its
        score against the answer of its prompt, `prompts_by_group[group id]`."""

        async def reward(turns):
            return await self.task_reward(turns, prompts_by_group[turns[-1].group_id].answer)

        return reward

    async def task_reward(self, turns, answer):
        """A finished trajectory's reward, from its last turn's response against the prompt's
        `answer`, computed off the event loop (`call_reward_off_loop`)."""
        last = turns[-1]
        if self.call_end_id is not None and last.response_ids[-1:].tolist() == [self.call_end_id]:
            return 0.0  # no answer to score (the call's arguments may hold the gold number)
        text = self.tokenizer.decode(last.response_ids.tolist(), skip_special_tokens=True)
        finished = last.finish_reason == "stop"
        return await call_reward_off_loop(
            self.reward_fn, text, answer, finished, self.pool, self.cfg.rollout.reward_timeout_s
        )


async def call_reward_off_loop(reward_fn, response_text, answer, finished, pool, timeout_s=0.0):
    """`call_reward` without blocking the event loop: an `async def` reward_fn is awaited, a plain
    one runs in `pool`. With `timeout_s`, a reward still running then is a RewardError (a thread
    cannot be stopped: it finishes in the background, its result dropped, and the pool starts
    another in its place: `DaemonPool.abandon`). The limit counts from the call, the wait for a
    free worker included. So with slow rewards, rollout.reward_workers should cover the
    trajectories that finish together."""
    where = f"on answer {answer!r}, response ...{response_text[-120:]!r}"
    if is_async(reward_fn):
        pending = call_async_reward(reward_fn, response_text, answer, finished)
    else:
        call = functools.partial(call_reward, reward_fn, response_text, answer, finished)
        submitted = pool.submit(call)
        pending = asyncio.wrap_future(submitted)
    try:
        return await asyncio.wait_for(pending, timeout_s or None)
    except asyncio.TimeoutError:
        if not is_async(reward_fn):  # its thread may never come back: another takes its place
            pool.abandon(submitted)
        raise RewardError(
            f"the reward function took longer than rollout.reward_timeout_s={timeout_s} {where}"
        ) from None


def is_async(fn):
    """Whether `fn` is awaited: an `async def` function (or a partial of one), or an object whose
    `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)
    )


async def call_async_reward(reward_fn, response_text, answer, finished):
    """An `async def` reward_fn's value, checked as `call_reward` checks a plain one's. It runs on
    the rollout's event loop, so it must not block: a blocking one (time.sleep, heavy work) stalls
    every request and outlasts rollout.reward_timeout_s, which only an await can end. Blocking
    work belongs in a plain function (it runs in rollout.reward_workers threads)."""
    where = f"on answer {answer!r}, response ...{response_text[-120:]!r}"
    try:
        value = await reward_fn(response_text, answer, finished=finished)
    # the user's function: counted, never a crash (SystemExit too: sys.exit() in code it runs;
    # and a CancelledError of its own, a BaseException that would end the whole rollout: only a
    # cancellation of this task, the rollout's, goes on as one)
    except (Exception, SystemExit, asyncio.CancelledError) as e:  # noqa: BLE001
        if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
            raise
        raise RewardError(f"the reward function raised {e!r} {where}") from e
    return checked(value, where)


# A group's statistics square its rewards' deviations in float64 (advantages.compute): past
# ~1.3e154 the square is inf, and every advantage of the group was 0, counted nowhere
MAX_REWARD = 1e150


def checked(value, where):
    """`value` as a float, or a RewardError: any finite real number up to MAX_REWARD in size is a
    reward (Python's and numpy's ints and floats, Fraction, Decimal, a one-element tensor), a bool
    is not, and one too large for a float (10**400) is refused as not finite."""
    try:  # the user's object: its own conversion may raise anything (a meta tensor's .item())
        number = real_number(value)
    except Exception:  # noqa: BLE001 - refused as what it is, counted like any other
        number = None
    if number is None or not math.isfinite(number):
        raise RewardError(
            f"the reward function returned {described(value)}, not a finite number, {where}"
        )
    value = number
    if abs(value) > MAX_REWARD:
        raise RewardError(
            f"the reward function returned {value!r}, over rewards.MAX_REWARD={MAX_REWARD:g} in "
            f"size (the group statistics square it in float64), {where}"
        )
    return value


def described(value):
    """`value`'s repr for a refusal, cut short; a repr may raise too (an int over Python's 4,300
    digits), and built only for a refusal: not on every reward's way."""
    try:
        return shown(value)
    except Exception:  # noqa: BLE001
        return f"a {type(value).__name__!r} whose repr raises"


def real_number(value):
    """`value` as a float, or None where it is not a real number (a bool is not one); raises
    where its conversion does (`checked` refuses those too)."""
    size = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)
    if size == 1 and hasattr(value, "item"):  # torch's numel, numpy's size
        value = value.item()  # a 0-dim (or one-element) tensor or array
    real = isinstance(value, (numbers.Real, decimal.Decimal))
    if isinstance(value, (bool, numpy.bool_)) or not real:
        return None
    return float(value)  # (10**400: OverflowError; Decimal's signalling NaN: ValueError)


def call_reward(reward_fn, response_text, answer, finished):
    """reward_fn(response_text, answer, finished) as a float, or RewardError. The three
    arguments: the text, since a reward judges what the model said (token ids would tie it to one
    tokenizer); the row's answer, whatever the reward compares against; and whether the response
    ended on its own (a stop token), not cut at the token budget, since a truncated answer may
    deserve less. What it returned, if not a finite number (a bool neither), and what it raised,
    become a RewardError naming the answer and the response's end."""
    where = f"on answer {answer!r}, response ...{response_text[-120:]!r}"
    try:
        value = reward_fn(response_text, answer, finished=finished)
    # the user's function: any error is counted, never a crash mid-rollout; SystemExit too (a
    # reward that runs model-written code may meet its sys.exit()), and asyncio's CancelledError
    # (a BaseException: a reward running asyncio.run whose coroutine was cancelled)
    except (Exception, SystemExit, asyncio.CancelledError) as e:  # noqa: BLE001
        raise RewardError(f"the reward function raised {e!r} {where}") from e
    if inspect.isawaitable(value):  # a plain function returning a coroutine: never awaited here
        if inspect.iscoroutine(value):
            value.close()  # no "never awaited" warning on top of the error
        raise RewardError(
            f"the reward function returned an awaitable {where}: make it `async def` (or its "
            "__call__) so it is awaited, or return a number"
        )
    return checked(value, where)


def load_reward(spec):
    """The function `spec` names (config.load_function), called as fn(response_text, answer,
    finished) -> float. One that cannot take those three arguments is a ConfigError here, before
    the engine starts."""
    fn = load_function(spec, "data.reward")
    check_signature(fn, f"data.reward={spec!r}: {spec.rpartition(':')[2]}")
    return fn


def check_signature(fn, named):
    """A ConfigError (`named` says which function) unless `fn` can be called as a reward is:
    fn(response_text, answer, finished=...)."""
    try:
        inspect.signature(fn).bind("response", "answer", finished=True)
    except TypeError as e:
        raise ConfigError(
            f"{named} must take (response_text, answer, finished), the third by that name: {e}"
        ) from None
    except ValueError:  # a builtin without a signature: called as is
        pass


# ---------------------------------------------------------------- the built-in rewards
# A number as written: thousands only in groups of three (1,234; "5,6,7" is a list, its last
# number 7), a decimal part, or a bare one (.5 is 0.5, not 5; not after a word or a point: the
# 5 of "apples.5" or "...5" is 5), then an exponent (1e3 is 1000, not 3: a chat task's float
# answer 6.02e23 is written "6.02e+23"; up to 3 digits, so decimal's arithmetic stays in range)
_NUMBER = re.compile(
    r"-?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])\.\d+)(?:[eE][-+]?\d{1,3}(?!\d))?"
)
# an answer: a number, a fraction (3/4 is 0.75, not 4; LaTeX's \frac{3}{4} likewise) or a mixed
# number (2 1/2 and 2\frac{1}{2} are 2.5, not 21/2)
_ANSWER = re.compile(rf"{_NUMBER.pattern}(?:/\d+|[ \t]+\d+/\d+)?")
# '####' then the answer on the same line (spaces, markdown bold or a dollar sign between): the
# format the prompt asks for (task/gsm8k.py), as verl's strict GSM8K rule reads it. A '####' with
# no number after it is a markdown heading ("#### Step 2: ..."), not an answer
_HASH_ANSWER = re.compile(rf"####[ \t*$]*({_ANSWER.pattern})")
_FRACTION = re.compile(r"\\[dt]?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}")
# LaTeX's and typography's thousands separators between a digit and the next group of three:
# 1\,080, 1{,}080, 1~080, a thin space; and U+2212, the minus sign
_SEPARATOR = re.compile(r"(?<=\d)(?:\\,|\\!|\{,\}|~|\u2009|\u202f)(?=\d{3}(?!\d))")


def positionwise(response_text, target):
    """1 for exactly `target`, else the share of positions where the two agree, over the longer
    one's length: the partial credit of the tiny tasks (task/tiny.py, tiny_tool.py, reverse.py)."""
    if response_text == target:
        return 1.0
    matches = sum(a == b for a, b in zip(response_text, target))
    return matches / max(len(response_text), len(target))


def parse_number(text):
    """The first answer in `text`, exact: '1,234.50' -> Decimal('1234.50'), '3/4' -> 0.75 (a
    float would make 123456789100 equal 123456789012 under a relative tolerance, and 400-digit
    numbers inf); None when the text holds no number."""
    match = _ANSWER.search(plain_digits(text).replace("$", ""))
    return value(match.group()) if match else None


def value(written):
    """An answer as _ANSWER matched it, a Decimal: separators dropped, a fraction divided (to
    decimal's 28 digits), a mixed number's parts added; None for a fraction over 0."""
    *whole, number = written.replace(",", "").split()
    number, _, denominator = number.partition("/")
    if denominator and decimal.Decimal(denominator) == 0:
        return None
    part = decimal.Decimal(number)  # exact: a division rounds to 28 digits
    if denominator:
        part /= decimal.Decimal(denominator)
    if not whole:
        return part
    whole = decimal.Decimal(whole[0])
    return whole - part if whole.is_signed() else whole + part  # -2 1/2 is -2.5


def is_number(text):
    """Whether `text` is one number as parse_number reads it, whole (after its LaTeX or
    typographic separators and dollar signs): "1,000" and "-5" are, "1/2" and "3-4" are not."""
    return _NUMBER.fullmatch(plain_digits(text).replace("$", "").strip()) is not None


def plain_digits(text):
    """`text` with its numbers as _ANSWER reads them: a LaTeX or typographic thousands separator
    a comma (1\\,080 was 1), the minus sign U+2212 a hyphen (\u22127 was 7), \\frac{3}{4} 3/4."""
    return _FRACTION.sub(r" \1/\2", _SEPARATOR.sub(",", text.replace("\u2212", "-")))


def after_thinking(response_text):
    """What a response answers, past its reasoning: a reasoning model (Qwen3 unless its chat
    template gets enable_thinking false, DeepSeek-R1) writes <think>...</think> before its
    answer, so the answer is the text after the last </think>, and a response whose <think> never
    closes (cut off mid-thought) has none: None, not the last number it thought of. Text without
    the tags is returned whole. (A template that opens <think> in the prompt leaves a cut-off
    response with no tag at all: read whole.) A <think> after the last </think>, or a literal
    one written by a model that does not reason, reads as a thought cut off: None."""
    end = response_text.rfind("</think>")
    rest = response_text[end + len("</think>") :] if end >= 0 else response_text
    return None if "<think>" in rest else rest


def extract_answer(response_text):
    """The model's final answer, read after its reasoning (`after_thinking`; None if that never
    ended): the number after the last '####' that has one on its line, else in the last
    \\boxed{} that holds one (a space between digit groups a separator there: 1 080), else the
    last number."""
    answer = after_thinking(response_text)
    if answer is None:
        return None
    text = plain_digits(answer)
    after_hashes = _HASH_ANSWER.findall(text)
    if after_hashes:
        return value(after_hashes[-1])
    boxed = last_boxed(text)
    if boxed is not None:
        number = parse_number(re.sub(r"(?<=\d) (?=\d{3}(?!\d))", ",", boxed))
        if number is not None:
            return number
    found = _ANSWER.findall(text.replace("$", ""))
    return value(found[-1]) if found else None


def last_boxed(text):
    """The content of the last \\boxed{...} that closes, braces inside it matched (LaTeX writes
    1{,}234), or None, in linear time: str.rfind, then one scan to its closing brace, where a
    regular expression's findall rescans the rest of the text after every unclosed "\\boxed{"
    (50,000 of them took over 50 s)."""
    close = text.rfind("}")
    start = text.rfind("\\boxed{", 0, close) if close >= 0 else -1
    if start < 0:
        return None
    start += len("\\boxed{")
    depth = 1
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end]
    return None


def gsm8k_reward(response_text, answer, finished):
    """1 when the extracted number equals the gold answer exactly (decimal arithmetic: 1,234.50
    equals 1234.5), else 0 (unfinished answers still count; one cut off mid-thought has none:
    after_thinking)."""
    predicted, gold = extract_answer(response_text), parse_number(answer)
    return float(predicted is not None and gold is not None and predicted == gold)
