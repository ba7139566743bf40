"""GSM8K: grade-school math word problems, a chat task (task/chat.py) of its own rows
{question, answer}: the question and an instruction as the prompt, the number after '####' as the
answer, scored by rewards.gsm8k_reward unless data.reward names another. A task module as
task/tiny.py describes.
"""

import rewards
import task.chat as chat

FIELDS = {
    "data.train_path",
    "data.val_path",
    "data.hub_subset",
    "data.chat_template_kwargs",
} | chat.TOOL_FIELDS
INSTRUCTION = "Solve the problem step by step. Put the final numeric answer after '####'."
reward = rewards.gsm8k_reward
check = chat.check  # rows to read
tool = chat.tool  # the same tools as any chat task


def row(row):
    """A GSM8K row as (prompt, answer): the question and the instruction; the gold number after
    '####'. ValueError (chat.chat_prompts counts and skips the row) when the answer is not a
    solution ending in '#### <number>': its gold would be some other number, or none that a
    response could ever match."""
    solution = row["answer"]
    if not isinstance(row["question"], str):  # a list of chat messages would print as Python's
        raise ValueError("its question is not a text")
    if not isinstance(solution, str) or "####" not in solution:
        raise ValueError("its answer is not a solution text ending in '#### <number>'")
    gold = solution.rsplit("####", 1)[-1].strip()
    # a number, whole: parse_number alone would read 0.5 from "1/2" and 3 from "3-4"
    if not rewards.is_number(gold):
        raise ValueError(f"not one number after its answer's '####': {gold[:40]!r}")
    return f"{row['question']}\n{INSTRUCTION}", gold


def prompts(cfg, tokenizer, split, seed, tool=None):
    """data.train_path's rows ("train") or data.val_path's (default: train_path's "test" split)
    as chat prompts, a hub dataset's configuration data.hub_subset (default "main"): `read`."""
    d = cfg.data
    return read(
        tokenizer,
        d.train_path if split == "train" else chat.val_source(d),
        "train" if split == "train" else "test",
        d.max_prompt_len,
        tool.schemas if tool is not None else None,
        d.hub_subset or "main",
        d.chat_template_kwargs,
    )


def read(tokenizer, source, split, max_prompt_len, tools=None, subset="main", template_kwargs=None):
    """GSM8K's rows of `source` as chat prompts (`row`; chat.chat_prompts reads and renders)."""
    return chat.chat_prompts(
        tokenizer,
        source,
        split,
        max_prompt_len,
        "question",
        "answer",
        tools,
        subset,
        row,
        template_kwargs,
    )


def answer_of(text):
    """What eval's maj@k votes on: the extracted number as its shortest exact text (1,234.50 and
    1234.5 vote alike, and -0 with 0)."""
    number = rewards.extract_answer(text)
    if number is None:
        return None
    return "0" if number.is_zero() else format(number.normalize(), "f")  # -0 votes with 0
