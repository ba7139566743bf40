"""Your own task: chat rows of a prompt and an answer, scored by the reward data.reward names.

Rows come from a local .jsonl (unparseable lines counted and skipped), a .parquet file or a hub
dataset; a row's prompt is a string (made one user message) or a list of chat messages, rendered
with the tokenizer's chat template (with the tools' descriptions when the trajectory has tools).
Malformed rows and over-long prompts are counted and skipped. GSM8K (task/gsm8k.py) is a chat
task of its own rows. A task module as task/tiny.py describes.
"""

import inspect
import json
import logging
import math
import os

import jinja2  # transformers renders chat templates with it
from transformers import PreTrainedTokenizerBase

from config import ConfigError
from sample import Prompt
from task.data import LOCAL_FORMATS, TOOL_FIELDS, DataError
import task.tools as tools

log = logging.getLogger("tasks")
# malformed rows warned of one by one; the rest are counted (a misnamed field would log each row)
MAX_ROW_WARNINGS = 5

FIELDS = {
    "data.train_path",
    "data.val_path",
    "data.hub_subset",
    "data.prompt_field",
    "data.answer_field",
    "data.chat_template_kwargs",
} | TOOL_FIELDS
reward = None  # the one data.reward names (`check`)
# apply_chat_template's own parameters (transformers' tokenization_utils_base.py), and the names
# it hands the template itself (utils/chat_template_utils.py: render_jinja_template's
# `conversations`, the template's `messages`): a data.chat_template_kwargs key among them would
# collide with what chat_prompts passes
TEMPLATE_ARGUMENTS = set(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - {"self", "kwargs"} | {"messages", "conversations"}


def check(cfg):
    """Rows to read, a reward to score them, and template variables that are not
    apply_chat_template's own arguments: named before any model loads."""
    task = cfg.data.task
    taken = sorted(set(cfg.data.chat_template_kwargs) & TEMPLATE_ARGUMENTS)
    if taken:
        raise ConfigError(
            f"data.chat_template_kwargs: {taken} are apply_chat_template's own arguments, which "
            "the task sets; only the template's variables go here"
        )
    if not cfg.data.train_path:
        raise ConfigError(
            f"data.task={task} needs data.train_path (a .jsonl/.parquet file or a hub name)"
        )
    if task == "chat" and not cfg.data.reward:
        raise ConfigError(
            "data.task=chat needs data.reward: 'path/to/file.py:function' or 'module:function'"
        )


def prompts(cfg, tokenizer, split, seed, tool=None):
    """The rows of data.train_path ("train"), or of data.val_path (default: train_path's "test"
    split) for "val", as chat prompts; the rows' order is the data's (`seed` unused: the prompt
    stream shuffles)."""
    d = cfg.data
    path = d.train_path if split == "train" else val_source(d)
    return chat_prompts(
        tokenizer,
        path,
        "train" if split == "train" else "test",
        d.max_prompt_len,
        prompt_field=d.prompt_field,
        answer_field=d.answer_field,
        tools=tool.schemas if tool is not None else None,
        subset=d.hub_subset,
        template_kwargs=d.chat_template_kwargs,
    )


def val_source(d):
    """Where validation reads (`d`: the data section): data.val_path, else train_path, whose
    "test" split a hub dataset has. A file has none: its own rows, which training samples too, so
    validation would score what it trains on; said in a warning (the run goes on: a smoke test
    may want it)."""
    if d.val_path:
        return d.val_path
    if os.path.isfile(d.train_path):
        log.warning(
            "data.val_path is empty: validation reads data.train_path=%s itself (a file has no "
            "test split), the rows training samples from; set data.val_path to held-out rows",
            d.train_path,
        )
    return d.train_path


def tool(cfg, tokenizer):
    """Its multi-turn trajectories' tools (rollout.max_turns > 1): the functions rollout.tools
    names (none: the calculator), called in the chat template's JSON format."""
    r = cfg.rollout
    return tools.QwenTools(
        tokenizer,
        tools.load_tools(r.tools),
        r.tool_timeout_s,
        r.tool_workers,
        r.max_observation_chars,
        tools.assistant_opening(tokenizer, cfg.data.chat_template_kwargs),
    )


def read_rows(source, split, subset=None):
    """Rows (dicts) from a local .jsonl (lines that are not UTF-8 JSON counted and skipped, blank
    ones ignored), a .parquet file, or a hub dataset's `split` (its configuration `subset`, e.g.
    GSM8K's "main") through `datasets`. An existing file is read as one whatever its name: one of
    another format is a DataError (the hub would say it found no data at a path that exists); a
    folder goes to `datasets`, which reads the data files in it."""
    extension = os.path.splitext(source)[1].lower()
    if extension in LOCAL_FORMATS and not os.path.isfile(source):
        raise DataError(f"dataset file not found: {source}")
    if os.path.isfile(source) and extension not in LOCAL_FORMATS:
        raise DataError(f"{source}: a local dataset must be a .jsonl or .parquet file")
    if extension == ".jsonl":
        return read_jsonl(source)
    import datasets  # parquet files and hub names ("openai/gsm8k") go through the library

    if extension == ".parquet":
        try:
            return list(datasets.load_dataset("parquet", data_files=source, split="train"))
        except Exception as e:  # an empty or damaged file: pyarrow's and datasets' own errors
            raise DataError(f"{source} cannot be read as parquet: {type(e).__name__}: {e}") from e
    try:
        return list(datasets.load_dataset(source, subset or None, split=split))
    except Exception as e:  # a folder of no data files, a hub id not reached: the library's errors
        raise DataError(
            f"{source}: not a local .jsonl or .parquet file, and datasets could not load it: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e


def read_jsonl(source):
    """The rows of a .jsonl file: a line that is not UTF-8 (a byte Python would turn into U+FFFD
    inside a prompt or an answer) or not JSON is counted and skipped; a byte-order mark and blank
    lines are not rows."""
    rows, num_bad = [], 0
    with open(source, "rb") as f:
        for line_no, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8-sig" if line_no == 1 else "utf-8")
                if text.strip():
                    rows.append(json.loads(text))
            except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both
                num_bad += 1
                log.warning("skipping unparseable row %s:%d (%s)", source, line_no, e)
    if num_bad:
        log.warning("%s: skipped %d unparseable rows of %d", source, num_bad, num_bad + len(rows))
    return rows


def row_problem(row, prompt_field, answer_field, max_chars):
    """Why a row cannot be used (None if it can): not a mapping; a missing answer, or one not a
    string or a finite number (JSON's NaN and Infinity would be the answers "nan" and "inf"); a
    prompt that is neither a string nor a list of {role, content} string messages; an empty or
    blank prompt (the model would answer nothing but the template); or a prompt longer than
    `max_chars` (checked before tokenizing: a huge field is never tokenized; the answer, never
    tokenized, may be long: a code task's tests)."""
    if not isinstance(row, dict):
        return f"expected an object, got {type(row).__name__}"
    answer, prompt = row.get(answer_field), row.get(prompt_field)
    is_number = isinstance(answer, (int, float)) and not isinstance(answer, bool)
    if not (isinstance(answer, str) or is_number) or (is_number and not math.isfinite(answer)):
        return f"needs a string or finite number field {answer_field!r}"
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
    if not any(text.strip() for text in texts):
        return f"an empty field {prompt_field!r}"
    length = sum(map(len, texts))
    if length > max_chars:
        return f"a prompt of {length} characters (limit {max_chars})"
    try:  # JSON can spell half a character (an emoji cut at "\ud83d"); no tokenizer takes it
        for text in [*texts, answer if isinstance(answer, str) else ""]:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (half of a character) in its text"
    return None


def answer_text(answer):
    """A row's answer as the reward gets it: text, an integral float as an int ("5", not "5.0": a
    pandas column of ints with one missing value is stored as floats) where a float holds every
    digit (below 2**53: 6.02e23 would be 601999999999999995805696, its rounding error)."""
    if isinstance(answer, float) and answer.is_integer() and abs(answer) < 2**53:
        return str(int(answer))
    return str(answer)


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
    template_kwargs=None,
):
    """Chat-formatted prompts from rows of a prompt (a string, made one user message, or a list
    of chat messages) and a reference answer, rendered with the tokenizer's chat template (with
    the tool descriptions when `tools` is given, and the template's own variables
    `template_kwargs`: data.chat_template_kwargs). `to_prompt(row) -> (prompt, answer)` reshapes
    a dataset's own rows (GSM8K's); malformed rows and prompts longer than `max_prompt_len`
    tokens are counted and skipped."""
    rows = read_rows(source, split, subset)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the tokenizer has no chat template: chat prompts are rendered with it (use an "
            "instruct model's tokenizer, or give the tokenizer a chat_template)"
        )
    prompts = []
    num_too_long = 0
    num_bad = 0
    first_problem = None  # said in the DataError when nothing was usable
    max_chars = 32 * max_prompt_len  # far more than a prompt of max_prompt_len tokens can hold
    for row_no, row in enumerate(rows, 1):
        problem = row_problem(row, prompt_field, answer_field, max_chars)
        if problem:
            num_bad += 1
            first_problem = first_problem or f"row {row_no}: {problem}"
            if num_bad <= MAX_ROW_WARNINGS:
                log.warning("skipping malformed row %s:%d (%s)", source, row_no, problem)
            continue
        try:  # a task's own row shape (`to_prompt` raises ValueError), or a template's rules
            prompt, answer = to_prompt(row) if to_prompt else (row[prompt_field], row[answer_field])
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **(template_kwargs or {}),
            )
        except (ValueError, jinja2.TemplateError) as e:  # e.g. "roles must alternate"
            num_bad += 1
            first_problem = first_problem or f"row {row_no}: {e}"
            if num_bad <= MAX_ROW_WARNINGS:
                log.warning("skipping malformed row %s:%d (%s)", source, row_no, e)
            continue
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) > max_prompt_len:
            num_too_long += 1
            continue
        prompts.append(Prompt(prompt_ids=ids, answer=answer_text(answer)))
    if num_bad:
        log.warning(
            "%s: skipped %d malformed rows (the first %d said)",
            source,
            num_bad,
            min(num_bad, MAX_ROW_WARNINGS),
        )
    if num_too_long:
        log.warning(
            "%s: skipped %d prompts longer than %d tokens", source, num_too_long, max_prompt_len
        )
    if not prompts:
        raise DataError(
            f"{source}: no usable prompts (malformed rows or all longer than {max_prompt_len}"
            + (f"; the first malformed: {first_problem})" if first_problem else ")")
        )
    return prompts
