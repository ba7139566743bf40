"""A small Qwen2.5-shaped model folder, built offline for the GSM8K rehearsal of the GPU configs.

Qwen2 architecture with tied embeddings and grouped KV heads; a byte-level BPE tokenizer trained
with `tokenizers` on the shipped GSM8K rows, with Qwen's pre-tokenizer and special tokens; a ChatML
chat template of our own that renders tools and tool responses in Qwen2.5's format; a
generation_config.json with both end-of-sequence ids. A random model never stops or calls a tool, so
a few seconds of supervised steps teach it the formats: answers end with `<|im_end|>`, and with the
tool schemas in the prompt it first writes a `<tool_call>` (to the calculator, or in a share of the
examples to examples/math_tools.py's percent_of; well-formed JSON, or in a share malformed) and
answers after the `<tool_response>`. Owns nothing the trainer uses: it only makes a folder that
`model.path` can name.
"""

import asyncio
import json
import os
import shutil
import sys
import random
import re

import torch

import task.gsm8k as gsm8k
import task.tools as tools

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# added tokens in Qwen2.5, not special: they stay in decoded text
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
# Qwen2's pre-tokenizer: contractions, letter runs, single digits, punctuation runs, newlines,
# spaces
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML; with `tools`, the system turn lists them and says how to call them; an assistant turn
# renders its tool calls as <tool_call> JSON, and a tool message is a user turn holding a
# <tool_response> (Qwen2.5's format, which tools.qwen_calculator's observations reproduce token for
# token).
TOOLS_SYSTEM = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_HOW = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)
# No text right after a block tag starts with a newline: transformers renders with trim_blocks,
# which drops it.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}"
    "{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}"
    "{{ "
    + repr(TOOLS_SYSTEM)
    + " }}{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ " + repr(TOOLS_HOW) + " }}"
    "{% elif messages[0].role != 'system' %}<|im_start|>system{{ '\\n' }}"
    "You are a helpful assistant.<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{% if not tools %}"
    "<|im_start|>system{{ '\\n' + m.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% elif m.role == 'user' %}<|im_start|>user{{ '\\n' + m.content }}<|im_end|>{{ '\\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\\n' + (m.content or '') }}"
    "{% for call in m.tool_calls or [] %}"
    "{{ '\\n' if m.content or not loop.first else '' }}<tool_call>{{ '\\n' }}"
    '{"name": "{{ call.function.name }}", '
    "\"arguments\": {{ call.function.arguments | tojson }}}{{ '\\n' }}</tool_call>"
    "{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif m.role == 'tool' %}<|im_start|>user{{ '\\n' }}"
    "<tool_response>{{ '\\n' + m.content + '\\n' }}</tool_response>"
    "<|im_end|>{{ '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


# The tools its tool examples list, as the suite's rehearsal of configs/gsm8k_tool.yaml gives
# them (`rollout.tools`): the built-in calculator and the README's example of your own tool, called
# in this share of the examples.
TOOLS = [tools.calculator, tools.load_tools(["examples/math_tools.py:percent_of"])[0]]
PERCENT_SHARE = 0.3


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def build_tokenizer(texts, vocab_size=1024):
    """Byte-level BPE trained on `texts`, wrapped for transformers, with Qwen's special tokens
    and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
    )
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TOKENS])
    return tokenizer


def last_calculation(answer):
    """The last `<<expression=value>>` annotation of a GSM8K answer (the expression), or the
    final number."""
    found = re.findall(r"<<([^=<>]+)=", answer)
    return found[-1] if found else answer.rsplit("####", 1)[-1].strip()


def sft_examples(tokenizer, data, rng, malformed_share=0.3):
    """(input ids, label mask) pairs, built the way the rollout builds contexts: a chat-template
    prompt, then each turn's tokens and each observation's tokens appended as ids (never
    re-tokenized together)."""
    tool = tools.QwenTools(tokenizer, TOOLS)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    examples = []
    for row in data:
        final = row["answer"].rsplit("####", 1)[-1].strip()
        answer_ids = encode(f"#### {final}<|im_end|>")
        for schemas in (None, tool.schemas):
            messages = [{"role": "user", "content": f"{row['question']}\n{gsm8k.INSTRUCTION}"}]
            prompt = encode(
                tokenizer.apply_chat_template(
                    messages, tools=schemas, tokenize=False, add_generation_prompt=True
                )
            )
            if schemas is None:
                examples.append((prompt + answer_ids, [0] * len(prompt) + [1] * len(answer_ids)))
                continue
            if rng.random() < PERCENT_SHARE:  # the example's second tool, on the question's numbers
                numbers = re.findall(r"\d+", row["question"])[:2] + ["10", "50"]
                arguments = f'{{"percent": {numbers[0]}, "value": {numbers[1]}}}'
                call = encode(
                    f'<tool_call>\n{{"name": "percent_of", "arguments": {arguments}}}\n</tool_call>'
                )
            else:
                expression = last_calculation(row["answer"])
                # unquoted: bad JSON
                value = json.dumps(expression) if rng.random() > malformed_share else expression
                call = encode(
                    '<tool_call>\n{"name": "calculator", '
                    f'"arguments": {{"expression": {value}}}}}\n</tool_call>'
                )
            observation = asyncio.run(tool(call)).ids
            ids = prompt + call + observation + answer_ids
            mask = (
                [0] * len(prompt) + [1] * len(call) + [0] * len(observation) + [1] * len(answer_ids)
            )
            examples.append((ids, mask))
    return examples


def supervised_steps(model, examples, steps, batch_size, lr, seed):
    """Next-token loss on the masked (assistant) tokens, padded batches, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.tensor([i if m else -100 for i, m in zip(ids, mask)])
        loss = model(
            input_ids=input_ids, attention_mask=attention, labels=labels, use_cache=False
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


# the model's shape (bench/families.py builds other families at it)
SHAPE = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def build(folder, data_path, steps=250, seed=0):
    """Write the model folder; returns the last supervised loss."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    data = rows(data_path)
    rng = random.Random(seed)
    corpus = [f"{r['question']}\n{gsm8k.INSTRUCTION}\n{r['answer']}" for r in data]
    corpus += [CHAT_TEMPLATE, *map(json.dumps, map(tools.function_schema, TOOLS))] * 20
    tokenizer = build_tokenizer(corpus)
    end_of_text, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    torch.manual_seed(seed)
    # config.json names only <|endoftext|> as eos (as Qwen2.5's base models do); <|im_end|> comes
    # from generation_config.json, so a stop at <|im_end|> shows that SGLang reads both
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **SHAPE,
        tie_word_embeddings=True,
        bos_token_id=end_of_text,
        eos_token_id=end_of_text,
        pad_token_id=end_of_text,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config).float()
    loss = supervised_steps(
        model, sft_examples(tokenizer, data, rng), steps, batch_size=16, lr=6e-3, seed=seed
    )
    # written beside the folder, then renamed: a reader (`test -d FOLDER`, another lane of the
    # suite's background runs) sees the whole model or none
    partial = f"{folder}.partial-{os.getpid()}"
    os.makedirs(partial)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    GenerationConfig(
        bos_token_id=end_of_text,
        eos_token_id=[im_end, end_of_text],
        pad_token_id=end_of_text,
        do_sample=True,
    ).save_pretrained(partial)
    try:
        os.rename(partial, folder)
    except OSError:  # another build finished first (the same seeded model): keep that one
        shutil.rmtree(partial)
    return loss


# `python tests/qwen_tiny.py FOLDER`, as the suite's background worker runs it
if __name__ == "__main__":
    torch.set_num_threads(1)  # one core: the suite's in-process tests hold the other
    build(
        sys.argv[1],
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gsm8k_train_100.jsonl"),
        steps=90,
    )
