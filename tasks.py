"""Tasks and rewards: the tiny CPU demo task (count letters), GSM8K, and the char tokenizer of the demo.

Owns prompt construction, data loading (bad rows counted and skipped) and reward functions.
Does not own the model, the engine or batching order (train.py draws batches from these lists).
"""
import dataclasses
import json
import logging
import math
import os
import random
import re

log = logging.getLogger("tasks")


class DataError(ValueError):
    """A data source that cannot be used at all (missing file, no usable rows)."""


@dataclasses.dataclass
class Prompt:
    prompt_ids: list[int]
    answer: str  # tiny: the count N as text; gsm8k: the gold number as text


# ---------------------------------------------------------------- tiny demo task
# Prompt "<bos>17:", target "a" * 17 then <eos>. N ~ 1/N up to max_count, so most answers are short
# and a few are long: the long-tailed length distribution RL rollouts have (shared/notes/tiny-demo.md).
TINY_CHARS = "0123456789:a"


def build_char_tokenizer(chars=TINY_CHARS):
    """A character-level tokenizer built locally with `tokenizers` (no download), HF-wrapped."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


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


# ---------------------------------------------------------------- GSM8K
GSM8K_INSTRUCTION = "Solve the problem step by step. Put the final numeric answer after '####'."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text):
    """'1,234.50' -> 1234.5; None when the text holds no number."""
    match = _NUMBER.search(text.replace("$", ""))
    return float(match.group().replace(",", "")) if match else None


def extract_answer(response_text):
    """The model's final answer: after the last '####', else in the last \\boxed{}, else the last number."""
    if "####" in response_text:
        return parse_number(response_text.rsplit("####", 1)[1])
    boxed = re.findall(r"\\boxed\{([^}]*)\}", response_text)
    if boxed:
        return parse_number(boxed[-1])
    numbers = _NUMBER.findall(response_text.replace("$", ""))
    return float(numbers[-1].replace(",", "")) if numbers else None


def gsm8k_reward(response_text, answer, finished):
    """1 when the extracted number equals the gold answer, else 0 (unfinished answers still count)."""
    predicted, gold = extract_answer(response_text), parse_number(answer)
    return float(predicted is not None and gold is not None and math.isclose(predicted, gold, abs_tol=1e-6))


def read_rows(source, split):
    """Rows {question, answer} from a local .jsonl (bad lines counted and skipped) or via `datasets`."""
    if source.endswith(".jsonl"):
        if not os.path.isfile(source):
            raise DataError(f"dataset file not found: {source}")
        rows, num_bad = [], 0
        with open(source) as f:
            for line_no, line in enumerate(f, 1):
                try:
                    row = json.loads(line)
                    if not (isinstance(row.get("question"), str) and isinstance(row.get("answer"), str)):
                        raise ValueError("needs string fields 'question' and 'answer'")
                    rows.append(row)
                except (ValueError, AttributeError) as e:
                    num_bad += 1
                    log.warning("skipping malformed row %s:%d (%s)", source, line_no, e)
        if num_bad:
            log.warning("%s: skipped %d malformed rows of %d", source, num_bad, num_bad + len(rows))
        return rows
    import datasets  # parquet files and hub names ("openai/gsm8k") go through the library

    if source.endswith(".parquet"):
        return list(datasets.load_dataset("parquet", data_files=source, split="train"))
    return list(datasets.load_dataset(source, "main", split=split))


def gsm8k_prompts(tokenizer, source, split, max_prompt_len):
    """Chat-formatted GSM8K prompts; prompts longer than `max_prompt_len` tokens are counted and skipped."""
    prompts, num_too_long = [], 0
    for row in read_rows(source, split):
        messages = [{"role": "user", "content": f"{row['question']}\n{GSM8K_INSTRUCTION}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) > max_prompt_len:
            num_too_long += 1
            continue
        prompts.append(Prompt(prompt_ids=ids, answer=row["answer"].rsplit("####", 1)[-1].strip()))
    if num_too_long:
        log.warning("%s: skipped %d prompts longer than %d tokens", source, num_too_long, max_prompt_len)
    if not prompts:
        raise DataError(f"{source}: no usable prompts (malformed rows or all longer than {max_prompt_len})")
    return prompts
