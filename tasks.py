"""Tasks and rewards: the tiny CPU demo tasks (count letters; calculator questions), chat datasets
(GSM8K and your own: rows of a prompt and an answer, a reward function named in the config), the
demos' char tokenizer, and the calculator tool adapters (the tiny demo's "?" and Qwen's JSON tool
calls).

Owns prompt construction, data loading (bad rows counted and skipped), loading a reward function and
the built-in ones. Does not own the model, the engine or batching order (PromptStream below hands
them out).
"""

import dataclasses
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import random
import re

from calculator import calculate

log = logging.getLogger("tasks")


class DataError(ValueError):
    """A data source that cannot be used at all (missing file, no usable rows)."""


class RewardError(ValueError):
    """A reward function raised, or returned something other than a finite number (the trajectory
    fails)."""


@dataclasses.dataclass
class Prompt:
    prompt_ids: list[int]
    # what the reward compares against: tiny: the count N; gsm8k: the gold number; chat: the row's
    # answer
    answer: str


# ---------------------------------------------------------------- tiny demo task Prompt "<bos>17:",
# target "a" * 17 then <eos>. N ~ 1/N up to max_count, so most answers are short and a few are long:
# the long-tailed length distribution RL rollouts have (shared/notes/tiny-demo.md).
TINY_CHARS = "0123456789:a+-.=*/()?"  # one vocab for both tiny tasks (tiny_tool uses "*-=?")


def build_char_tokenizer(chars=TINY_CHARS):
    """A character-level tokenizer built locally with `tokenizers` (no download), HF-wrapped."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def tiny_prompts(tokenizer, num_prompts, max_count, seed):
    """`num_prompts` prompts with N drawn with weight 1/N from 1..max_count (fixed by `seed`)."""
    rng = random.Random(seed)
    counts = list(range(1, max_count + 1))
    weights = [1 / n for n in counts]
    prompts = []
    for n in rng.choices(counts, weights=weights, k=num_prompts):
        ids = [tokenizer.bos_token_id] + tokenizer(f"{n}:", add_special_tokens=False).input_ids
        prompts.append(Prompt(prompt_ids=ids, answer=str(n)))
    return prompts


def tiny_reward(response_text, answer, finished):
    """Positionwise credit for N copies of 'a': 1 for exact, 0 if the sample never emitted <eos>."""
    if not finished:
        return 0.0
    target = "a" * int(answer)
    if response_text == target:
        return 1.0
    matches = sum(a == b for a, b in zip(response_text, target))
    return matches / max(len(response_text), len(target))


# ---------------------------------------------------------------- tiny tool task Prompt
# "<bos>37*85-3141=", answer "4": a product minus a number just below it, so the answer is a digit
# from 2 to 9 that depends jointly on the last digits of all three numbers (no pair of them tells
# it) and not at all on the leading ones. A ~130k-parameter model does not learn that from its
# reward in minutes: without the tool it guesses (1 in 8). The call is one token, "?", ending a
# turn: the calculator evaluates the question and the rollout appends "=4"; the model answers by
# repeating the digit. Random init ends its first turn with "?" in about a quarter of the samples,
# so calls are found by sampling.
def tiny_tool_prompts(tokenizer, num_prompts, digits, seed):
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        a, b = rng.randint(10 ** (digits - 1), 10**digits - 1), rng.randint(
            10 ** (digits - 1), 10**digits - 1
        )
        answer = rng.randint(2, 9)
        ids = [tokenizer.bos_token_id] + tokenizer(
            f"{a}*{b}-{a * b - answer}=", add_special_tokens=False
        ).input_ids
        prompts.append(Prompt(prompt_ids=ids, answer=str(answer)))
    return prompts


def tiny_tool_reward(response_text, answer, finished):
    """Positionwise credit of the final answer (the last turn's text), whether or not it ended: 1
    for exactly the digit. A last turn that is a call ("...?") was never answered: 0."""
    if response_text.endswith("?"):
        return 0.0
    matches = sum(a == b for a, b in zip(response_text, answer))
    return matches / max(len(response_text), len(answer))


class CalculatorTool:
    """Turns a response that ends in a tool call into observation tokens for the next turn.

    Called by rollout.py with the response ids and the trajectory's prompt ids; returns (observation
    ids, is_error), or None when the response makes no tool call (it is the answer). The call is
    untrusted model text: it only ever reaches calculator.calculate, which parses it and answers
    errors as text, never by raising.
    """

    def __init__(self, tokenizer, call_start, call_end, parse_call, format_observation):
        self.tokenizer, self.call_start, self.call_end = tokenizer, call_start, call_end
        # rollout stops generation on it
        self.call_end_id = tokenizer.convert_tokens_to_ids(call_end)
        self.parse_call, self.format_observation = parse_call, format_observation

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


# ---------------------------------------------------------------- GSM8K
GSM8K_INSTRUCTION = "Solve the problem step by step. Put the final numeric answer after '####'."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text):
    """'1,234.50' -> 1234.5; None when the text holds no number."""
    match = _NUMBER.search(text.replace("$", ""))
    return float(match.group().replace(",", "")) if match else None


def extract_answer(response_text):
    """The model's final answer: after the last '####', else in the last \\boxed{}, else the last
    number."""
    if "####" in response_text:
        return parse_number(response_text.rsplit("####", 1)[1])
    boxed = re.findall(r"\\boxed\{([^}]*)\}", response_text)
    if boxed:
        return parse_number(boxed[-1])
    numbers = _NUMBER.findall(response_text.replace("$", ""))
    return float(numbers[-1].replace(",", "")) if numbers else None


def gsm8k_reward(response_text, answer, finished):
    """1 when the extracted number equals the gold answer, else 0 (unfinished answers still
    count)."""
    predicted, gold = extract_answer(response_text), parse_number(answer)
    return float(
        predicted is not None and gold is not None and math.isclose(predicted, gold, abs_tol=1e-6)
    )


def read_rows(source, split, subset=None):
    """Rows (dicts) from a local .jsonl (unparseable lines counted and skipped), a .parquet file,
    or a hub dataset's `split` (its configuration `subset`, e.g. GSM8K's "main") through
    `datasets`."""
    if source.endswith(".jsonl"):
        if not os.path.isfile(source):
            raise DataError(f"dataset file not found: {source}")
        rows, num_bad = [], 0
        with open(source, errors="replace") as f:  # undecodable bytes become U+FFFD, not a crash
            for line_no, line in enumerate(f, 1):
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    num_bad += 1
                    log.warning("skipping unparseable row %s:%d (%s)", source, line_no, e)
        if num_bad:
            log.warning(
                "%s: skipped %d unparseable rows of %d", source, num_bad, num_bad + len(rows)
            )
        return rows
    import datasets  # parquet files and hub names ("openai/gsm8k") go through the library

    if source.endswith(".parquet"):
        if not os.path.isfile(source):
            raise DataError(f"dataset file not found: {source}")
        return list(datasets.load_dataset("parquet", data_files=source, split="train"))
    return list(datasets.load_dataset(source, subset or None, split=split))


def row_problem(row, prompt_field, answer_field, max_chars):
    """Why a row cannot be used (None if it can): not a mapping; a missing answer, or one not a
    string or a number; a prompt that is neither a string nor a list of {role, content} string
    messages; or a text longer than `max_chars` (checked before tokenizing: a huge field is never
    tokenized)."""
    if not isinstance(row, dict):
        return f"expected an object, got {type(row).__name__}"
    answer, prompt = row.get(answer_field), row.get(prompt_field)
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        return f"needs a string or number field {answer_field!r}"
    if isinstance(prompt, list):
        if not prompt or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        ):
            return f"field {prompt_field!r}: a list of messages needs {{'role': str, 'content': str}} items"
        texts = [m["content"] for m in prompt]
    elif isinstance(prompt, str):
        texts = [prompt]
    else:
        return f"needs a string (or message list) field {prompt_field!r}"
    length = sum(map(len, texts)) + len(str(answer))
    if length > max_chars:
        return f"a prompt and answer of {length} characters (limit {max_chars})"
    return None


def chat_prompts(
    tokenizer,
    source,
    split,
    max_prompt_len,
    prompt_field="prompt",
    answer_field="answer",
    tools=None,
    subset=None,
    to_prompt=None,
):
    """Chat-formatted prompts from rows of a prompt (a string, made one user message, or a list
    of chat messages) and a reference answer, rendered with the tokenizer's chat template (with
    the tool descriptions when `tools` is given). `to_prompt(row) -> (prompt, answer)` reshapes a
    dataset's own rows (GSM8K's); malformed rows and prompts longer than `max_prompt_len` tokens
    are counted and skipped."""
    rows = read_rows(source, split, subset)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the tokenizer has no chat template: chat prompts are rendered with it (use an "
            "instruct model's tokenizer, or give the tokenizer a chat_template)"
        )
    prompts, num_too_long, num_bad = [], 0, 0
    max_chars = 32 * max_prompt_len  # far more than a prompt of max_prompt_len tokens can hold
    for row_no, row in enumerate(rows, 1):
        problem = row_problem(row, prompt_field, answer_field, max_chars)
        if problem:
            num_bad += 1
            log.warning("skipping malformed row %s:%d (%s)", source, row_no, problem)
            continue
        prompt, answer = to_prompt(row) if to_prompt else (row[prompt_field], row[answer_field])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) > max_prompt_len:
            num_too_long += 1
            continue
        prompts.append(Prompt(prompt_ids=ids, answer=str(answer)))
    if num_bad:
        log.warning("%s: skipped %d malformed rows", source, num_bad)
    if num_too_long:
        log.warning(
            "%s: skipped %d prompts longer than %d tokens", source, num_too_long, max_prompt_len
        )
    if not prompts:
        raise DataError(
            f"{source}: no usable prompts (malformed rows or all longer than {max_prompt_len})"
        )
    return prompts


def gsm8k_row(row):
    """GSM8K's rows as (prompt, answer): the question and the instruction; the gold number after
    '####'."""
    return f"{row['question']}\n{GSM8K_INSTRUCTION}", row["answer"].rsplit("####", 1)[-1].strip()


def gsm8k_prompts(tokenizer, source, split, max_prompt_len, tools=None, subset="main"):
    """GSM8K: a chat dataset of its own {question, answer} rows (`gsm8k_row`)."""
    return chat_prompts(
        tokenizer, source, split, max_prompt_len, "question", "answer", tools, subset, gsm8k_row
    )


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
    except (
        Exception
    ) as e:  # noqa: BLE001 - the user's function: any error is counted, never a crash mid-rollout
        raise RewardError(f"the reward function raised {e!r} {where}") from e
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"the reward function returned {value!r}, not a finite number, {where}")
    return float(value)


def load_reward(spec):
    """The function `spec` names: "path/to/file.py:function" or "module:function" (importable
    from the working directory). Called as fn(response_text, answer, finished) -> float. A
    missing file, module or function, or one that cannot take those three arguments, is a
    ConfigError here, before the engine starts."""
    from config import ConfigError

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(
            f"data.reward={spec!r}: expected 'path/to/file.py:function' or 'module:function'"
        )
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ConfigError(f"data.reward={spec!r}: no file {where}")
        module_spec = importlib.util.spec_from_file_location(
            f"reward_{os.path.basename(where)[:-3]}", where
        )
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"data.reward={spec!r}: cannot import {where!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"data.reward={spec!r}: {where} has no function {name!r}")
    try:
        inspect.signature(fn).bind("response", "answer", finished=True)
    except TypeError as e:
        raise ConfigError(
            f"data.reward={spec!r}: {name} must take (response_text, answer, finished): {e}"
        ) from None
    except ValueError:  # a builtin without a signature: called as is
        pass
    return fn


# ---------------------------------------------------------------- the trainer's view
def build_task(cfg, tokenizer):
    """(train prompts, validation prompts, reward function, tool or None) for `data.task`."""
    d, seed = cfg.data, cfg.train.seed
    if d.task == "tiny":
        train = tiny_prompts(tokenizer, d.num_tiny_prompts, d.tiny_max_count, seed=seed)
        val = tiny_prompts(tokenizer, d.num_val_prompts, d.tiny_max_count, seed=seed + 1)
        return train, val, tiny_reward, None
    if d.task == "tiny_tool":
        train = tiny_tool_prompts(tokenizer, d.num_tiny_prompts, d.tiny_operand_digits, seed=seed)
        val = tiny_tool_prompts(tokenizer, d.num_val_prompts, d.tiny_operand_digits, seed=seed + 1)
        # 1 turn: no tool
        tool = QuestionCalculator(tokenizer) if cfg.rollout.max_turns > 1 else None
        return train, val, tiny_tool_reward, tool
    use_tool = cfg.rollout.max_turns > 1
    tools = [CALCULATOR_SCHEMA] if use_tool else None
    # gsm8k: a chat dataset of its own rows, with its own reward unless the config names one; chat:
    # the rows' fields and the reward the config names (loaded first: a wrong one is named before
    # any data is read)
    reward_fn = load_reward(d.reward) if d.reward else gsm8k_reward
    sources = ((d.train_path, "train"), (d.val_path or d.train_path, "test"))
    if d.task == "gsm8k":
        train, val = (
            gsm8k_prompts(tokenizer, path, split, d.max_prompt_len, tools, d.hub_subset or "main")
            for path, split in sources
        )
    else:
        train, val = (
            chat_prompts(
                tokenizer,
                path,
                split,
                d.max_prompt_len,
                d.prompt_field,
                d.answer_field,
                tools,
                d.hub_subset,
            )
            for path, split in sources
        )
    return (
        train,
        val[: d.num_val_prompts],
        reward_fn,
        qwen_calculator(tokenizer) if use_tool else None,
    )


class PromptStream:
    """One rank's stream of training prompts: epochs of a seeded shuffle of the whole set, rank r
    reading every world_size-th prompt of it from r (ranks never share a prompt within an epoch).
    A step takes as many as it launches (with dynamic sampling, a varying number), so the
    stream's `position` (prompts this rank has read) is the data position: checkpoints store
    every rank's and `--resume` reads on."""

    def __init__(self, prompts, seed, rank=0, world_size=1, position=0):
        self.prompts, self.seed, self.rank, self.world_size, self.position = (
            prompts,
            seed,
            rank,
            world_size,
            position,
        )
        self._epoch, self._order = None, None

    def take(self, count):
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.rank + self.world_size * self.position, len(self.prompts))
            if epoch != self._epoch:
                self._epoch, self._order = epoch, list(range(len(self.prompts)))
                random.Random(self.seed * 100_003 + epoch).shuffle(self._order)
            out.append(self.prompts[self._order[offset]])
            self.position += 1
        return out

    @classmethod
    def for_rank(cls, prompts, seed, rank, world_size, positions=None):
        """This rank's stream, at its position in a checkpoint's `positions` (one per rank that
        wrote it). The same world size reads on exactly; another one starts every rank where the
        old ranks had read up to together. No positions (a new run, or a checkpoint from before
        prompt streams): from the start."""
        if not positions:
            position = 0
        elif len(positions) == world_size:
            position = positions[rank]
        else:
            position = math.ceil(sum(positions) / world_size)
        return cls(prompts, seed, rank, world_size, position)
