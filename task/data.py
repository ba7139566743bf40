"""Tasks: the prompts a run trains and validates on. The tiny CPU demo tasks (count letters; a
calculator question), chat datasets (GSM8K and your own rows of a prompt and an answer), and the
prompt stream each rank reads from.

Owns prompt construction and data loading (bad rows counted and skipped), and which reward and tool
each task uses (`build_task`). Does not own the rewards (rewards.py), the tools (tools.py), the
model or the engine.
"""

import dataclasses
import json
import logging
import math
import os
import random

import rewards
import runtime.seeds as seeds
from config import ConfigError, refuse_unread
from sample import Prompt
import task.tools as tools

log = logging.getLogger("tasks")

TASKS = ("tiny", "tiny_tool", "gsm8k", "chat")  # data.task: see build_task


# The data fields each task reads beyond the ones every task reads (task, reward, max_prompt_len,
# num_val_prompts), and the rollout fields its tools read (gsm8k and chat with max_turns > 1:
# tools.QwenTools; tiny_tool's calculator reads none). `check` refuses any other of them set to a
# value but its default: a field nothing reads would look like it took effect (the test that this
# table is what build_task reads: tests/test_config_and_tasks.py).
TASK_FIELDS = {
    "tiny": {"data.tiny_max_count", "data.num_tiny_prompts"},
    "tiny_tool": {"data.tiny_operand_digits", "data.num_tiny_prompts"},
    "gsm8k": {"data.train_path", "data.val_path", "data.hub_subset"},
    "chat": {
        "data.train_path",
        "data.val_path",
        "data.hub_subset",
        "data.prompt_field",
        "data.answer_field",
    },
}
TOOL_FIELDS = {
    "rollout.tools",
    "rollout.tool_timeout_s",
    "rollout.tool_workers",
    "rollout.max_observation_chars",
}


def fields_read(cfg):
    """The task-specific fields (TASK_FIELDS, TOOL_FIELDS) the configured task and turns read."""
    read = set(TASK_FIELDS[cfg.data.task])
    if cfg.data.task in ("gsm8k", "chat") and cfg.rollout.max_turns > 1:
        read |= TOOL_FIELDS
    return read


def _readers(key):
    tasks = [task for task, keys in TASK_FIELDS.items() if key in keys]
    if tasks:
        return f"by data.task {' or '.join(tasks)}"
    return "by the tools of data.task gsm8k or chat with rollout.max_turns > 1"


# config.refuse_unread's table of this module's fields
READ_WHEN = {
    key: (lambda cfg, key=key: key in fields_read(cfg), _readers(key))
    for key in sorted(set().union(*TASK_FIELDS.values(), TOOL_FIELDS))
}


def check(cfg):
    """data.task's choice and what it needs (assemble.load_config calls this at load); a
    task-specific field set for a task or mode that does not read it is a ConfigError."""
    d = cfg.data
    if d.task not in TASKS:
        raise ConfigError(f"data.task={d.task!r}: expected one of {TASKS}")
    refuse_unread(cfg, READ_WHEN)
    if d.task in ("gsm8k", "chat") and not d.train_path:
        raise ConfigError(
            f"data.task={d.task} needs data.train_path (a .jsonl/.parquet file or a hub name)"
        )
    if d.task == "chat" and not d.reward:
        raise ConfigError(
            "data.task=chat needs data.reward: 'path/to/file.py:function' or 'module:function'"
        )


class DataError(ValueError):
    """A data source that cannot be used at all (missing file, no usable rows)."""


# ---------------------------------------------------------------- tiny demo task
# Prompt "<bos>17:", target "a" * 17 then <eos>. N ~ 1/N up to max_count, so most answers are short
# and a few are long: the long-tailed length distribution RL rollouts have.
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


# ---------------------------------------------------------------- tiny tool task
# Prompt "<bos>37*85-3141=", answer "4": a product minus a number just below it, so the answer is a
# digit from 2 to 9 that depends jointly on the last digits of all three numbers (no pair of them
# tells it) and not at all on the leading ones. A ~130k-parameter model does not learn that from
# its reward in minutes: without the tool it guesses (1 in 8). The call is one token, "?", ending a
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


# ---------------------------------------------------------------- chat rows and GSM8K
GSM8K_INSTRUCTION = "Solve the problem step by step. Put the final numeric answer after '####'."


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
            return (
                f"field {prompt_field!r}: a list of messages needs "
                "{'role': str, 'content': str} items"
            )
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
    prompts = []
    num_too_long = 0
    num_bad = 0
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


# ---------------------------------------------------------------- the trainer's view
@dataclasses.dataclass
class Task:
    """What a run trains on: its prompts, how a response is rewarded, and its tool."""

    train_prompts: list[Prompt]
    val_prompts: list[Prompt]
    reward_fn: object  # (response_text, answer, finished) -> float; see rewards.call_reward
    # multi-turn tasks (rollout.max_turns > 1): tools.QwenTools or tools.QuestionCalculator
    tool: object


def build_task(cfg, tokenizer):
    """The `Task` that `data.task` names, its prompts tokenized with `tokenizer`."""
    d = cfg.data
    train_seed = seeds.derive(cfg.train.seed, "prompts", "train")
    val_seed = seeds.derive(cfg.train.seed, "prompts", "val")
    use_tool = cfg.rollout.max_turns > 1  # one turn: no tool, whatever the task
    if d.task == "tiny":
        train = tiny_prompts(tokenizer, d.num_tiny_prompts, d.tiny_max_count, train_seed)
        val = tiny_prompts(tokenizer, d.num_val_prompts, d.tiny_max_count, val_seed)
        return Task(train, val, task_reward(d, rewards.tiny_reward), tool=None)
    if d.task == "tiny_tool":
        digits = d.tiny_operand_digits
        train = tiny_tool_prompts(tokenizer, d.num_tiny_prompts, digits, train_seed)
        val = tiny_tool_prompts(tokenizer, d.num_val_prompts, digits, val_seed)
        tool = tools.QuestionCalculator(tokenizer) if use_tool else None
        return Task(train, val, task_reward(d, rewards.tiny_tool_reward), tool)
    # gsm8k: a chat dataset of its own rows, with its own reward unless the config names one; chat:
    # the rows' fields and the reward the config names (loaded first: a wrong one is named before
    # any data is read)
    reward_fn = task_reward(d, rewards.gsm8k_reward)
    r = cfg.rollout
    tool = (
        tools.QwenTools(
            tokenizer,
            tools.load_tools(r.tools),
            r.tool_timeout_s,
            r.tool_workers,
            r.max_observation_chars,
        )
        if use_tool
        else None
    )
    schemas = tool.schemas if use_tool else None  # rendered by the chat template
    prompts = {}
    for split, path in (("train", d.train_path), ("test", d.val_path or d.train_path)):
        if d.task == "gsm8k":
            prompts[split] = gsm8k_prompts(
                tokenizer,
                path,
                split,
                d.max_prompt_len,
                tools=schemas,
                subset=d.hub_subset or "main",
            )
        else:
            prompts[split] = chat_prompts(
                tokenizer,
                path,
                split,
                d.max_prompt_len,
                prompt_field=d.prompt_field,
                answer_field=d.answer_field,
                tools=schemas,
                subset=d.hub_subset,
            )
    return Task(prompts["train"], prompts["test"][: d.num_val_prompts], reward_fn, tool)


def task_reward(d, default):
    """The reward `data.reward` names (every task honours it), else the task's own `default`."""
    return rewards.load_reward(d.reward) if d.reward else default


class PromptStream:
    """One rank's stream of training prompts: epochs of a seeded shuffle of the whole set, rank r
    reading every world_size-th prompt of it from r (ranks never share a prompt within an epoch).
    A step takes as many as it launches (with dynamic sampling, a varying number), so the
    stream's `position` (prompts this rank has read) is the data position: checkpoints store
    every rank's and `--resume` reads on."""

    def __init__(self, prompts, seed, rank=0, world_size=1, position=0):
        self.prompts = prompts
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = position  # prompts this rank has read
        self._epoch, self._order = None, None

    def take(self, count):
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.rank + self.world_size * self.position, len(self.prompts))
            if epoch != self._epoch:
                self._epoch, self._order = epoch, list(range(len(self.prompts)))
                random.Random(seeds.derive(self.seed, "stream", epoch)).shuffle(self._order)
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
