"""Config errors, data loading with bad rows, and reward parsing on real GSM8K rows."""

import asyncio
import glob
import json
import logging
import math
import os
import re
import runpy
import sys

import pytest
import torch

import runtime.model as model
import task.data as tasks
import task.gsm8k as gsm8k
import task.chat as chat
import task.tiny as tiny
import task.tiny_tool as tiny_tool
import task.tools as tools
import sample
import advantages
import rewards
from config import ConfigError, config_yaml, load_yaml, read_config
from assemble import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The first 100 rows of GSM8K's train split (MIT, tests/data/GSM8K_LICENSE): shipped so the tests
# need no download.
GSM8K_TRAIN = os.path.join(ROOT, "tests", "data", "gsm8k_train_100.jsonl")
GSM8K_ROWS = 100


def test_yaml_and_set_overrides_are_typed():
    """--set overrides on top of a YAML file are parsed to each field's type (float, int, bool);
    an int where a float is expected becomes a float."""
    cfg = load_config(
        os.path.join(ROOT, "configs/tiny.yaml"),
        ["train.lr=1e-3", "rollout.group_size=4", "train.scale_by_std=false", "train.kl_coef=1"],
    )
    assert cfg.train.lr == 1e-3 and cfg.rollout.group_size == 4 and cfg.train.scale_by_std is False
    assert isinstance(cfg.train.kl_coef, float)  # an int is accepted where a float is expected


def test_numbers_are_read_as_yaml_1_2_in_a_file_and_a_set(tmp_path):
    """PyYAML reads YAML 1.1, where `010` is 8 (octal), `1:30` is 90 (base 60) and `yes` is
    True: a seed typed with a leading zero changed silently. The file and --set now read 1.2's
    numbers, and the config.yaml a run writes reads back to the same values, strings that look
    like numbers included. An integer too long for Python is a ConfigError."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  seed: 010\n  lr: 1e-3\nrun:\n  out: 2026-11-27\n")
    cfg = read_config(str(path), ["train.steps=020", "rollout.top_p=.5"])
    assert (cfg.train.seed, cfg.train.steps, cfg.train.lr) == (10, 20, 1e-3)
    assert (cfg.rollout.top_p, cfg.run.out) == (0.5, "2026-11-27")
    with pytest.raises(ConfigError, match="run.val_every='1:30': expected int"):
        read_config(None, ["run.val_every=1:30"])
    with pytest.raises(ConfigError, match="rollout.partial='yes': expected bool"):
        read_config(None, ["rollout.partial=yes"])
    # past Python's 4,300 digits int() raises ValueError, which escaped as itself
    path.write_text(f"train:\n  steps: {'9' * 5000}\n")
    with pytest.raises(ConfigError, match=r"run.yaml is not valid YAML: .*value has 5000 digits"):
        read_config(str(path))
    with pytest.raises(ConfigError, match=r"9\.\.\.9+': the value is not .*value has 5000 digits"):
        read_config(None, [f"train.steps={'9' * 5000}"])
    with pytest.raises(ConfigError, match=r"\(not an integer: 'abc': invalid literal for int"):
        read_config(None, ["train.steps=!!int abc"])
    for out in ("010", "1e3", "yes", "1:30", "2026-11-27", "0x1F"):
        cfg.run.out = out
        assert read_config(values=load_yaml(config_yaml(cfg))) == cfg


def test_a_set_naming_one_entry_of_a_mapping_keeps_the_others():
    """`--set train.loss_terms.b=2` adds one entry to the mapping (a second term does not drop
    the first: it did, silently); a whole mapping as the value replaces the entries before it."""
    cfg = read_config(None, ["train.loss_terms={a: 1}", "train.loss_terms.b=2"])
    assert cfg.train.loss_terms == {"a": 1.0, "b": 2.0}
    cfg = read_config(None, ["train.loss_terms.b=2", "train.loss_terms={a: 1}"])
    assert cfg.train.loss_terms == {"a": 1.0}
    with pytest.raises(ConfigError, match=re.escape("train.loss_terms={'b': 'many'}: expected")):
        read_config(None, ["train.loss_terms.b=many"])  # each entry still type-checked


@pytest.mark.parametrize("name", ["gsm8k.yaml", "gsm8k_tool.yaml", "gsm8k_dapo.yaml"])
def test_gpu_configs_are_sized_for_eight_ranks_with_bf16_compute(name):
    """Each shipped GPU config computes and serves in bf16, uses every visible GPU, splits its
    prompts into whole groups over 8 ranks, and has a small learning rate and an
    importance-sampling cap of at least 1."""
    cfg = load_config(os.path.join(ROOT, "configs", name), [f"data.train_path={GSM8K_TRAIN}"])
    assert (cfg.model.compute_dtype, cfg.model.engine_dtype) == ("bfloat16", "bfloat16")
    assert cfg.run.nproc == 0  # every visible GPU
    assert cfg.rollout.prompts_per_step % 8 == 0  # whole groups on each of 8 ranks
    assert cfg.train.lr <= 1e-5 and cfg.train.tis_cap >= 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.nope=1", "unknown config key 'train.nope'"),
        ("nosection.lr=1", "unknown config key 'nosection'"),
        ("train.steps=many", "train.steps='many': expected int"),
        ("train.steps=1.5", "expected int"),
        ("train.loss_agg=mean", "train.loss_agg='mean': expected one of"),
        ("rollout.cancel=later", "rollout.cancel"),
        ("rollout.drop_rate=1.5", "drop_rate"),
        ("train.lr", "expected section.key=value"),
        ("train.lr=[", "not a valid YAML scalar"),
        ("data.task=gsm8k", "needs data.train_path"),
        ("train.tis_cap=0.5", "train.tis_cap=0.5: expected 0"),
        ("model.dtype=bfloat16", "replaced by model.compute_dtype"),
        ("model.compute_dtype=float16", "model.compute_dtype='float16': expected one of"),
        ("run.nproc=-1", "run.nproc=-1"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    """A bad --set (unknown key or section, wrong type, value out of range, malformed, a replaced
    key) is a ConfigError naming the key and what was expected."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [override])


def test_unknown_key_in_yaml(tmp_path):
    """An unknown key in a YAML file, a file that is not valid YAML, and a key written twice in
    one mapping (PyYAML kept the last: a value, or a whole section, was lost unseen) are
    ConfigErrors naming the problem."""
    path = tmp_path / "bad.yaml"
    for text, message in (
        ("train:\n  learning_rate: 0.1\n", "train.learning_rate"),
        ("train: [unclosed\n", "is not valid YAML"),
        (
            "train:\n  lr: 0.1\ntrain:\n  steps: 3\n",
            "'train' is written twice in one mapping \\(line 3\\)",
        ),
        ("train: {lr: 0.1, lr: 0.2}\n", "bad.yaml: 'lr' is written twice"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(str(path))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "train.nope=1"], "unknown config key 'train.nope'"),
        (["--config", "configs/missing.yaml"], "config file not found"),
        (
            ["--set", "data.task=gsm8k", "--set", "data.train_path=/nonexistent/train.jsonl"],
            "dataset file not found",
        ),
        (
            ["--set", "model.path=/nonexistent/model"],
            "model.path='/nonexistent/model' could not be loaded",
        ),
        (["--set", "run.nproc=1000000"], "run.nproc=1000000 but this machine has"),
        # checked before the ranks start: one line, not each rank's error (1 rank on a GPU box)
        (
            ["--set", "run.nproc=2", "--set", "rollout.prompts_per_step=3"],
            "rollout.prompts_per_step=3 must divide evenly over 2 ranks",
        ),
    ],
)
def test_cli_fatal_errors_exit_nonzero_with_a_message(tmp_path, monkeypatch, capsys, args, message):
    """train.py's own `__main__` (run here with runpy: these fail before the engine starts, so no
    process of their own is needed) turns each into exit code 2 and one line, no traceback."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["train.py", *args, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and message in stderr and "Traceback" not in stderr


def test_a_folder_without_data_or_tokenizer_files_exits_with_a_message(
    tmp_path, monkeypatch, capsys
):
    """A reviewer found two tracebacks: a data path `datasets` cannot load (a folder without data
    files; a `.json` typo goes to the hub) and a model folder without tokenizer files (a
    ValueError, where a missing folder was a ModelError). Each is a named error now, exit 2, with
    the loader's first line."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, message in (
        (["--set", "data.task=gsm8k", f"--set=data.train_path={empty}"], "datasets could not load"),
        (
            [
                f"--set=model.path={empty}",
                "--set=data.task=gsm8k",
                f"--set=data.train_path={GSM8K_TRAIN}",
            ],
            "could not be loaded",
        ),
    ):
        test_cli_fatal_errors_exit_nonzero_with_a_message(
            tmp_path / "out", monkeypatch, capsys, args, message
        )
    # a loader's error with no text (a bare ValueError()): its type (its first line was an
    # IndexError out of the message's own making)
    assert str(model.unloadable("m", ValueError())).endswith("could not be loaded: ValueError")


def test_malformed_jsonl_rows_are_counted_and_skipped(tmp_path, caplog):
    """Unparseable lines and rows of the wrong shape are skipped and counted in warnings: for
    GSM8K also an answer that is no solution ending in '#### <number>' (a number, no '####', no
    number after it, more than one number after it: "1/2" read 1 and "3-4" read 3) and a
    question that is no text; for any chat task a row its chat template refuses and an empty or
    blank prompt. The good rows load."""
    path = tmp_path / "rows.jsonl"
    good = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    bad_answers = [7, "2 + 3 is 5", "2 + 3 = five\n#### five", "#### 1/2", "#### 3-4"]
    rows = [json.dumps(good), "{not json", json.dumps({"question": 1}), "[]", json.dumps(good)]
    rows += [json.dumps({"question": "What is 2 + 3?", "answer": a}) for a in bad_answers]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    rows += [json.dumps({"question": q, "answer": "#### 5"}) for q in (messages, "", "  ")]
    path.write_text("\n".join(rows))
    prompts = gsm8k.read(_wide_char_tokenizer(), str(path), "train", max_prompt_len=512)
    assert [p.answer for p in prompts] == ["5", "5"]
    assert (
        "skipped 1 unparseable rows of 13" in caplog.text
        and "skipped 10 malformed rows" in caplog.text
    )
    tokenizer = _wide_char_tokenizer()  # a template with rules: no system message
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    blank = [{"role": "user", "content": " "}]
    rows = ["2+3?", system, "", blank]
    path.write_text("\n".join(json.dumps({"prompt": p, "answer": "5"}) for p in rows))
    prompts = chat.chat_prompts(tokenizer, str(path), "train", max_prompt_len=512)
    assert len(prompts) == 1 and "no system role" in caplog.text
    assert "skipped 3 malformed rows" in caplog.text


def _wide_char_tokenizer():
    """A local tokenizer covering GSM8K text, with a plain chat template (no download)."""
    tokenizer = model.build_char_tokenizer(chars="".join(chr(c) for c in range(32, 127)) + "\n")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def test_chat_template_kwargs_reach_the_template_and_are_checked():
    """data.chat_template_kwargs (gsm8k, chat): each variable reaches the tokenizer's chat template
    (Qwen3's enable_thinking: false writes an empty think block into its prompts), one entry can
    be set alone with --set; a non-scalar or NaN value, or a key that is apply_chat_template's own
    argument (which the task passes itself), is a ConfigError."""
    tokenizer = _wide_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    sets = [f"data.train_path={GSM8K_TRAIN}", "data.max_prompt_len=1024"]
    for more, marked in (([], False), (["data.chat_template_kwargs.enable_thinking=false"], True)):
        cfg = load_config(os.path.join(ROOT, "configs/gsm8k.yaml"), sets + more)
        prompts = gsm8k.prompts(cfg, tokenizer, "train", seed=0)
        texts = [tokenizer.decode(p.prompt_ids) for p in prompts[:5]]
        assert all(t.endswith("<think></think>") == marked for t in texts), more
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    bad = {
        "data.chat_template_kwargs={tools: []}": "expected a mapping of names to booleans",
        "data.chat_template_kwargs={x: .nan}": "expected a mapping of names to booleans",
        "data.chat_template_kwargs={tokenize: true}": "apply_chat_template's own arguments",
        "data.chat_template_kwargs={tools: 1}": "apply_chat_template's own arguments",
        "data.chat_template_kwargs={messages: 1}": "apply_chat_template's own arguments",
        "data.chat_template_kwargs={conversations: 1}": "apply_chat_template's own arguments",
    }
    for item, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(os.path.join(ROOT, "configs/gsm8k.yaml"), sets + [item])


# Qwen3's way with enable_thinking false: the generation prompt holds an empty think block
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def test_every_tool_turn_opens_as_the_template_opens_the_first():
    """With tools' turns, each observation ends by opening the next assistant turn as the chat
    template's generation prompt does under data.chat_template_kwargs: Qwen3's empty think block
    with enable_thinking false (else the model thinks again from its second turn), the plain
    opening without it, and Qwen's opening for a template that is not Qwen's."""
    tokenizer = qwen_tool_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    quiet = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tools.assistant_opening(tokenizer, {"enable_thinking": False}) == quiet
    assert tools.assistant_opening(tokenizer, {}) == tools.QWEN_OPENING
    sets = [f"data.train_path={GSM8K_TRAIN}", "rollout.max_turns=2", "rollout.partial=false"]
    sets += ["data.chat_template_kwargs.enable_thinking=false"]
    tool = chat.tool(load_config(os.path.join(ROOT, "configs/gsm8k.yaml"), sets), tokenizer)
    call = tokenizer('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}')
    response = call.input_ids + [tool.call_end_id]
    observation = asyncio.run(tool(response))
    ending = tool.encode("\n</tool_response><|im_end|>\n" + quiet)
    assert tool.opening == quiet and observation.ids[-len(ending) :] == ending
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tools.assistant_opening(tokenizer, {}) == tools.QWEN_OPENING


def qwen_tool_tokenizer():
    """_wide_char_tokenizer with Qwen's tool-call and chat tokens as special tokens."""
    tokenizer = _wide_char_tokenizer()
    specials = ["<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>"]
    specials += ["<tool_response>", "</tool_response>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def test_validation_on_the_training_file_itself_is_said(caplog):
    """With data.val_path empty, a hub dataset validates on its test split, but a local file has
    none: validation reads the training rows themselves, which a warning now says (it was
    silent: an offline GSM8K run validated on what it trained on)."""
    sets = [f"data.train_path={GSM8K_TRAIN}", "data.val_path=''", "data.max_prompt_len=1024"]
    cfg = load_config(os.path.join(ROOT, "configs/gsm8k.yaml"), sets)
    val = gsm8k.prompts(cfg, _wide_char_tokenizer(), "val", seed=0)
    assert len(val) == GSM8K_ROWS and "validation reads data.train_path=" in caplog.text
    caplog.clear()
    cfg.data.val_path = GSM8K_TRAIN
    gsm8k.prompts(cfg, _wide_char_tokenizer(), "val", seed=0)
    assert "validation reads" not in caplog.text


def test_over_long_prompts_are_counted_and_skipped(caplog):
    """Prompts longer than max_prompt_len are dropped and counted; a limit that leaves none is a
    DataError."""
    tokenizer = _wide_char_tokenizer()
    prompts = gsm8k.read(tokenizer, GSM8K_TRAIN, "train", max_prompt_len=250)
    assert 0 < len(prompts) < GSM8K_ROWS
    assert all(len(p.prompt_ids) <= 250 for p in prompts)
    assert f"skipped {GSM8K_ROWS - len(prompts)} prompts longer than 250 tokens" in caplog.text
    with pytest.raises(tasks.DataError, match="no usable prompts"):
        gsm8k.read(tokenizer, GSM8K_TRAIN, "train", max_prompt_len=5)


def test_gsm8k_reward_on_real_rows():
    """On 50 real GSM8K rows the reference solution scores 1 and a wrong final number 0; a boxed
    answer, a thousands separator and a last number in the text are read; no number scores 0."""
    rows = chat.read_rows(GSM8K_TRAIN, "train")[:50]
    for row in rows:
        gold = row["answer"].rsplit("####", 1)[1].strip()
        solution = row["answer"]  # the reference solution ends in "#### <answer>": full credit
        assert rewards.gsm8k_reward(solution, gold, finished=True) == 1.0
        wrong = str(int(rewards.parse_number(gold)) + 1)
        assert rewards.gsm8k_reward(f"So the answer is #### {wrong}", gold, finished=True) == 0.0
    assert rewards.gsm8k_reward("... so \\boxed{1,234}", "1234", True) == 1.0
    assert rewards.gsm8k_reward("She pays $18 in total.", "18", True) == 1.0
    assert rewards.gsm8k_reward("no number here", "18", True) == 0.0


def test_gsm8k_answers_in_the_forms_an_instruct_model_writes():
    """A reviewer's real-data count found correct answers scored 0: a markdown heading "#### Step
    1: ..." was read as the '####' answer (its first number: 1), on 8,593 of GSM8K's 8,792 rows
    written that way; LaTeX's thin space (1\\,080) and the minus sign U+2212 cut the number. On the
    shipped rows: each solution under step headings, ending in its boxed answer, scores 1 and a
    wrong box 0; a '####' followed by a number still wins over the box."""
    for row in chat.read_rows(GSM8K_TRAIN, "train")[:50]:
        work, gold = (part.strip() for part in row["answer"].rsplit("####", 1))
        number = int(rewards.parse_number(gold))
        written = f"#### Step 1: Read the problem\n{work}\n#### Step 2: Answer\n"
        assert rewards.gsm8k_reward(written + f"\\boxed{{{gold}}}", gold, True) == 1.0, written
        assert rewards.gsm8k_reward(written + f"\\boxed{{{number + 1}}}", gold, True) == 0.0
        assert rewards.gsm8k_reward(f"#### {gold}\n\\boxed{{{number + 1}}}", gold, True) == 1.0
    for text in (
        "\\boxed{1\\,080}",
        "\\boxed{1 080}",
        "#### 1\\,080",
        "#### 1{,}080",
        "#### $1,080.00",
    ):
        assert rewards.gsm8k_reward(text, "1080", True) == 1.0, text
    assert rewards.gsm8k_reward("\\boxed{\u22127}", "-7", True) == 1.0
    assert rewards.gsm8k_reward("The answer is 18.\n####", "18", True) == 1.0  # no number after
    assert rewards.gsm8k_reward("1 080 apples", "1080", True) == 0.0  # a space only inside a box


def test_tiny_task_and_reward():
    """The tiny task's counts are drawn with weight 1/N (short targets dominate) behind "N:"
    prompts; its reward is 1 for N a's ending in <eos>, partial credit for a wrong count or other
    characters, 0 without <eos>."""
    tokenizer = model.build_char_tokenizer()
    prompts = tiny.draw(tokenizer, 2000, 32, seed=0)
    counts = [int(p.answer) for p in prompts]
    assert counts.count(1) > 5 * counts.count(10) > 0  # weight 1/N: short targets dominate
    assert tokenizer.decode(prompts[0].prompt_ids, skip_special_tokens=True) == f"{counts[0]}:"
    assert tiny.reward("aaa", "3", finished=True) == 1.0
    assert tiny.reward("aaa", "3", finished=False) == 0.0  # never emitted <eos>
    assert tiny.reward("aa", "4", finished=True) == 0.5
    assert tiny.reward("aa1aaa", "3", finished=True) == pytest.approx(2 / 6)


def test_a_tiny_budget_too_short_for_the_longest_answers_is_named(caplog):
    """data.tiny_max_count=200 with rollout.max_new_tokens=48: answers of 48 or more a's cannot
    end in <eos>, so about 24% of prompts (by weight 1/N) always score 0; said at load. The
    demo's own config (32 letters and <eos> in 48 tokens) says nothing."""
    with caplog.at_level(logging.WARNING, logger="task"):
        load_config("configs/tiny.yaml", [])
        assert not caplog.text
        load_config("configs/tiny.yaml", ["data.tiny_max_count=200"])
    assert "answers of 48 or more letters" in caplog.text
    assert "about 24% of prompts always score 0" in caplog.text


def test_tiny_tool_task_needs_the_calculator_and_the_tool_answers_it():
    """Prompts "a*b-c=" whose value is a digit 2..9, spread evenly; "?" ending a turn gets that
    value from the calculator, and the reward scores the answer, a call never answered as 0."""
    tokenizer = model.build_char_tokenizer()
    prompts = tiny_tool.draw(tokenizer, 2000, 2, seed=0)
    tool = tools.QuestionCalculator(tokenizer)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    for p in prompts[:50]:
        question = tokenizer.decode(p.prompt_ids, skip_special_tokens=True)
        a, rest = question.removesuffix("=").split("*")
        b, c = rest.split("-")
        assert (
            int(a) * int(b) - int(c) == int(p.answer) and 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        )
        for call in ("?", "31?"):  # text before the "?" is ignored
            observation = asyncio.run(tool(ids(call), p.prompt_ids))
            assert not observation.is_error and tokenizer.decode(observation.ids) == "=" + p.answer
        # no call: the turn is the answer
        assert asyncio.run(tool(ids("3"), p.prompt_ids)) is None
    answers = [p.answer for p in prompts]
    assert set(answers) == set("23456789") and max(map(answers.count, set(answers))) < 0.15 * len(
        answers
    )
    # a one-token turn ends by length
    assert tiny_tool.reward("4", "4", finished=False) == 1.0
    assert tiny_tool.reward("5", "4", finished=True) == 0.0
    assert tiny_tool.reward("43", "4", finished=True) == 0.5
    # a call never answered is no answer
    assert tiny_tool.reward("4?", "4", finished=True) == 0.0


def test_qwen_tool_call_format_round_trip():
    """The chat-template tool format (Qwen2.5/Qwen3): a JSON call is parsed and answered in a tool
    turn, a malformed one is answered with an error, and a response without a call gets None."""
    tokenizer = qwen_tool_tokenizer()
    tool = tools.QwenTools(tokenizer, [tools.calculator])

    def call(text):
        return asyncio.run(tool(tokenizer(text, add_special_tokens=False).input_ids))

    observation, name, is_error, ran = call(
        'I add. <tool_call>\n{"name": "calculator", '
        '"arguments": {"expression": "48 + 24"}}\n</tool_call>'
    )
    assert not is_error and ran and name == "calculator"
    assert tokenizer.decode(observation) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n72\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    for bad in [
        '<tool_call>{"name": "calculator"}</tool_call>',
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {"expression": 5}}</tool_call>',
        "</tool_call>",
        '<tool_call>{"arguments": {"expression": "__import__(\'os\')"}}</tool_call>',
    ]:
        observation, _, is_error, ran = call(bad)
        assert is_error and not ran and "error" in tokenizer.decode(observation)
    assert call("The answer is 72.") is None  # no tool call: the response is the answer


def test_unknown_key_suggests_the_closest_known_one():
    """A misspelt key names the known key it is closest to (difflib), in any section; a key set
    in the wrong section names the section that has it (train.max_new_tokens was offered
    train.max_token_staleness, which loads: the setting went to another field, silently)."""
    with pytest.raises(ConfigError, match="did you mean 'rollout.group_size'"):
        load_config(None, ["rollout.groupsize=4"])
    with pytest.raises(ConfigError, match="did you mean 'train.lr_schedule'"):
        load_config(None, ["train.lr_shedule=cosine"])
    with pytest.raises(ConfigError, match="did you mean 'rollout.max_new_tokens'"):
        load_config(None, ["train.max_new_tokens=64"])
    with pytest.raises(ConfigError, match="did you mean 'train.lr'"):
        load_config(None, ["lr=1e-4"])


def test_help_says_what_the_command_does_and_lists_the_configs(capsys):
    """`python train.py --help` describes the command (not a docstring's first line) and lists
    the shipped configs."""
    import train

    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "Train a language model with GRPO" in text and "configs/tiny.yaml" in text
    assert all(f"configs/{name}" in text for name in os.listdir("configs"))


def test_cosine_schedule_decays_to_the_floor_and_constant_stays():
    """lr_factor: the warmup ramps linearly over warmup_steps steps' updates, constant then stays
    at 1, cosine starts at 1 where the warmup ends, passes 1 - (1 - floor) / 2 halfway through the
    rest and ends exactly at min_lr_ratio on the last update. A reviewer found the warmup counted
    optimizer updates (gsm8k_dapo.yaml's 10 steps of 4 minibatches warmed up over 2.5 steps) and
    the cosine running under it from update 0 (a 50-of-100 warmup peaked at 0.565 x lr)."""
    from runtime.model import lr_factor

    cfg = load_config(None, ["train.warmup_steps=4", "train.min_lr_ratio=0.1"])
    t = cfg.train
    assert [lr_factor(u, 100, t) for u in (0, 3, 50, 99)] == [0.25, 1.0, 1.0, 1.0]
    t.num_minibatches = 2  # 4 steps are 8 updates
    assert [lr_factor(u, 200, t) for u in (0, 3, 7, 8)] == [0.125, 0.5, 1.0, 1.0]
    t.num_minibatches, t.lr_schedule = 1, "cosine"
    assert lr_factor(0, 105, t) == pytest.approx(0.25)  # warmup still applies
    assert lr_factor(4, 105, t) == 1.0  # the cosine begins at the warmup's end
    assert lr_factor(54, 105, t) == pytest.approx(0.55)
    assert lr_factor(104, 105, t) == pytest.approx(0.1)
    assert lr_factor(500, 105, t) == pytest.approx(0.1)  # never below the floor
    assert lr_factor(4, 5, t) == pytest.approx(0.1)  # one update after the warmup: the last
    t.warmup_steps = 0  # the demo's schedule: a cosine from update 0
    assert lr_factor(0, 101, t) == 1.0 and lr_factor(50, 101, t) == pytest.approx(0.55)
    # the optimizer's schedule spans every update: steps x num_minibatches (a reviewer found no
    # test of it: sized in steps, a cosine of 2 minibatches reached its floor half-way)
    t.num_minibatches, t.steps = 2, 10
    _, scheduler = model.build_optimizer(torch.nn.Linear(2, 2), t)
    for _ in range(t.steps):  # half the run's 20 updates
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(t.lr * lr_factor(10, 20, t))
    assert scheduler.get_last_lr()[0] > t.lr * (t.min_lr_ratio + 0.3)


def test_a_warmup_as_long_as_the_run_is_said(caplog):
    """train.warmup_steps >= train.steps: the rate never reaches train.lr and the schedule after
    the warmup never begins (a reviewer's 100-of-200 warmup ended at 0.4 x lr, min_lr_ratio
    unread). Said at load, not refused: a short smoke run of a shipped config (the README's GPU
    smoke test: gsm8k.yaml's 10-step warmup, 3 steps) is meant."""
    with caplog.at_level("WARNING"):
        load_config(None, ["train.warmup_steps=10", "train.steps=3", "train.lr=1e-6"])
    said = "train.warmup_steps=10 >= train.steps=3: the rate never reaches train.lr (1e-06; the "
    assert said + "last step's is 0.3 of it)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_config(None, ["train.warmup_steps=10", "train.steps=11"])
    assert "warmup_steps" not in caplog.text


def test_the_trajectory_token_bound_is_one_formula():
    """config.max_trajectory_tokens, which the rollout, DAPO's overlong penalty and Dr. GRPO's
    constant all read: one turn never exceeds max_new_tokens, even under a larger
    max_response_tokens (two formulas disagreed there); with tools, max_response_tokens bounds the
    whole trajectory, tool observations included, and may exceed max_new_tokens x max_turns (the
    tool demo: 1 x 2 < 4)."""
    from config import max_trajectory_tokens

    assert max_trajectory_tokens(48, 1) == 48 and max_trajectory_tokens(48, 1, 100) == 48
    assert max_trajectory_tokens(48, 1, 20) == 20
    assert max_trajectory_tokens(1, 2, 4) == 4 and max_trajectory_tokens(10, 3) == 30
    cfg = load_config("configs/tiny_tool.yaml", ["run.out=/tmp/unused"])
    assert cfg.rollout.max_trajectory_tokens() == 4


def test_any_finite_real_number_is_a_reward_and_nothing_else():
    """A reward may return numpy's (scalars and one-element arrays), torch's, Fraction's or
    Decimal's numbers; a bool, several values, a string, NaN, a number too large for a float
    (10**400: an OverflowError before), one whose square is (1e155) and one whose conversion
    raises (a meta tensor) are RewardErrors."""
    import decimal
    import fractions

    import numpy
    import torch

    for value, expected in (
        (numpy.float32(0.5), 0.5),
        (numpy.int64(1), 1.0),
        (numpy.array(0.5), 0.5),  # 0-dim, as numpy.where returns
        (numpy.array([0.25]), 0.25),
        (torch.tensor(0.25), 0.25),
        (fractions.Fraction(1, 4), 0.25),
        (decimal.Decimal("0.75"), 0.75),
        (2, 2.0),
    ):
        assert rewards.checked(value, "here") == expected

    class BrokenFloat(fractions.Fraction):  # a Real whose own conversion raises
        def __float__(self):
            raise TypeError("no float for you")

    refused = (True, numpy.bool_(True), numpy.array(True), numpy.array([0.5, 1.0]), "1", math.nan)
    # and one whose own conversion or repr raises (it escaped as its own error: no count, no
    # checkpoint; 10**5000's repr is over Python's 4,300 digits)
    broken = (torch.empty((), device="meta"), BrokenFloat(1), decimal.Decimal("sNaN"), 10**5000)
    for value in refused + broken + (10**400, decimal.Decimal("NaN")):
        with pytest.raises(rewards.RewardError, match="not a finite number"):
            rewards.checked(value, "here")
    # finite, but its square is not (a group of [1e155, 0, 0, 0] had advantages all 0, counted
    # nowhere: a reviewer's script)
    assert rewards.checked(-1e150, "here") == -1e150
    with pytest.raises(rewards.RewardError, match="over rewards.MAX_REWARD=1e.150 in size"):
        rewards.checked(1e155, "here")


def test_a_reward_that_exits_is_a_reward_error():
    """sys.exit() inside a reward (one that runs model-written code may meet it), plain or async,
    is a RewardError like any raise: SystemExit is no Exception, and it ended the run."""
    import asyncio

    def exits(response_text, answer, finished):
        sys.exit(3)

    async def exits_later(response_text, answer, finished):
        sys.exit(0)

    with pytest.raises(rewards.RewardError, match="SystemExit"):
        rewards.call_reward(exits, "5", "5", True)
    with pytest.raises(rewards.RewardError, match="SystemExit"):
        asyncio.run(rewards.call_async_reward(exits_later, "5", "5", True))


def test_a_reward_raising_its_own_cancelled_error_is_a_reward_error():
    """asyncio's CancelledError is a BaseException: a reward raising one of its own (an async
    judge whose request its client cancelled; a plain one running asyncio.run) escaped as a
    cancellation and ended the whole rollout, with no checkpoint. It is a RewardError now; the
    rollout's own cancellation of the task still cancels it."""
    import asyncio

    def plain(response_text, answer, finished):
        raise asyncio.CancelledError()

    async def judge(response_text, answer, finished):
        raise asyncio.CancelledError()

    async def slow(response_text, answer, finished):
        await asyncio.sleep(10)

    with pytest.raises(rewards.RewardError, match="CancelledError"):
        rewards.call_reward(plain, "5", "5", True)
    with pytest.raises(rewards.RewardError, match="CancelledError"):
        asyncio.run(rewards.call_async_reward(judge, "5", "5", True))

    async def cancelled_by_the_rollout():
        task = asyncio.ensure_future(rewards.call_async_reward(slow, "5", "5", True))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task.cancelled()

    assert asyncio.run(cancelled_by_the_rollout())


def test_gsm8k_answers_compare_exactly():
    """Exact decimal comparison: 123456789100 is not 123456789012 (a relative tolerance said it
    was), 400-digit numbers are not equal because both overflow, and 1,234.50 is 1234.5."""
    assert rewards.gsm8k_reward("#### 123456789100", "123456789012", True) == 0.0
    assert rewards.gsm8k_reward("#### 123456789012", "123456789012", True) == 1.0
    big = "9" * 400
    assert rewards.gsm8k_reward(f"#### {big}", big[:-1] + "8", True) == 0.0
    assert rewards.gsm8k_reward(f"#### {big}", big, True) == 1.0
    assert rewards.gsm8k_reward("so \\boxed{1,234.50}", "1234.5", True) == 1.0
    assert rewards.gsm8k_reward("it is 7 then 12", "12", False) == 1.0


def test_gsm8k_reads_lists_fractions_and_bare_decimals_as_written():
    """The number reader took any run of digits and commas as one number and stopped at a slash
    or a leading point: "5,6,7" scored as 567, "3/4" and \\frac{3}{4} as 4 (or 3 in a box), ".5" as
    5. Thousands now come in groups of three, a fraction is its value, a mixed number (2 1/2,
    2\\frac{1}{2}) its sum and .5 is 0.5; maj@k votes 3/4 with 0.75. A fraction over 0 is no
    answer. An exponent is read (1e3 was 3, and a float gold "6.02e+23" 6.02)."""
    for text, gold, score in (
        ("5,6,7", "567", 0.0),
        ("5,6,7", "7", 1.0),
        ("so she has 3/4 left", "4", 0.0),
        ("so she has 3/4 left", "0.75", 1.0),
        ("\\boxed{\\frac{3}{4}}", "3", 0.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("#### .5", "5", 0.0),
        ("#### .5", "0.5", 1.0),
        ("so we get...5 apples", "5", 1.0),  # a point after a word or a point: 5, not 0.5
        ("10 apples.5 of them are red", "5", 1.0),
        ("\\boxed{2\\frac{1}{2}}", "2.5", 1.0),  # a mixed number, not 21/2
        ("\\boxed{2\\frac{1}{2}}", "10.5", 0.0),
        ("she drank 1 1/2 cups", "1.5", 1.0),
        ("she drank 1 1/2 cups", "0.5", 0.0),
        ("#### -2 1/2", "-2.5", 1.0),
        ("#### 1/0", "1", 0.0),
        ("#### 1,234,567.5", "1234567.5", 1.0),
        ("it cost 48/2=24 dollars, so 24", "24", 1.0),
        ("about 1e3 people", "3", 0.0),  # an exponent: 1000, not its last digits
        ("about 1e3 people", "1000", 1.0),
        ("#### 602000000000000000000000", "6.02e+23", 1.0),  # a chat task's float answer's text
        ("#### 1.5E-2", "0.015", 1.0),
        ("2e fleet, 3 eggs", "3", 1.0),  # no digit after the e: no exponent
    ):
        assert rewards.gsm8k_reward(text, gold, True) == score, (text, gold)
    assert gsm8k.answer_of("#### 3/4") == gsm8k.answer_of("it is 0.75") == "0.75"
    assert gsm8k.answer_of("1e3") == gsm8k.answer_of("1,000") == "1000"
    assert rewards.parse_number("1,2345") == 1 and not rewards.is_number("1/2")


def test_answers_are_extracted_from_hostile_text_in_one_pass():
    """The last closed \\boxed{} and the last complete <answer>...</answer> are found with rfind,
    not a regular expression that rescans after every unclosed opener (350 KB of "\\boxed{" took
    over 50 s to score before; here it is one pass, and the answer is still found after it: all
    four hostile calls together within 2 s, where a rescan takes minutes). Braces inside a box
    are matched (LaTeX's 1{,}234)."""
    import time

    from examples.countdown.reward import countdown_reward

    assert rewards.last_boxed("so \\boxed{12} and \\boxed{7}.") == "7"
    assert rewards.last_boxed("\\boxed{12} then \\boxed{ unclosed") == "12"
    assert rewards.last_boxed("\\boxed{}") == "" and rewards.last_boxed("no box") is None
    assert rewards.gsm8k_reward("so \\boxed{1{,}234}", "1234", True) == 1.0
    assert rewards.gsm8k_reward("\\boxed{\\$1{,}200}", "1200", True) == 1.0
    hostile = "\\boxed{" * 50_000
    row = json.dumps({"target": 2, "numbers": [6, 3]})
    start = time.perf_counter()
    assert rewards.gsm8k_reward(hostile, "3", True) == 0.0
    assert rewards.gsm8k_reward("\\boxed{3}" + hostile, "3", True) == 1.0
    assert countdown_reward("<answer>" * 50_000, row, True) == 0.0
    assert countdown_reward("<answer>6 / 3</answer>" + "<answer>" * 50_000, row, True) == 1.0
    assert time.perf_counter() - start < 2.0


def test_a_reasoning_models_answer_is_read_after_its_thinking():
    """GSM8K's answer (the reward, and eval's maj@k vote) is read after the last </think>: a
    '####' or number inside the reasoning does not count, a response cut off mid-thought (an
    unclosed <think>) has no answer, and one without the tags is read whole. A template that
    opens <think> in the prompt (DeepSeek-R1's) leaves only the closing tag in the response."""
    thought = "<think>Eggs: 16 - 3 - 4 = 9, so #### 18?</think>\nSo she makes $18. #### 18"
    assert rewards.extract_answer(thought) == 18
    assert rewards.gsm8k_reward("<think>Maybe #### 18.</think> The answer is 20.", "18", True) == 0
    assert rewards.gsm8k_reward("<think>16 - 7 = 9, times 2 is 18", "18", False) == 0
    assert rewards.extract_answer("<think>16 - 7 = 9, times 2 is 18") is None
    assert rewards.extract_answer("9 times 2 is 18") == 18  # no tags: read whole
    assert rewards.extract_answer("9 times 2 is 18.</think>#### 18") == 18
    assert rewards.extract_answer("<think>a</think> It is 5. <think>or 7") is None  # cut off
    assert gsm8k.answer_of("<think>1 or 2</think>\\boxed{3}") == "3"


def test_a_reward_file_with_a_dataclass_loads(tmp_path):
    """data.reward's file is run as a module registered under its name, as importlib's recipe
    does: a dataclass in it (with postponed annotations) loads (it raised AttributeError)."""
    from config import load_function

    path = tmp_path / "judge.py"
    path.write_text(
        "from __future__ import annotations\n"
        "import dataclasses\n\n\n"
        "@dataclasses.dataclass\n"
        "class Rule:\n"
        "    bonus: float = 1.0\n\n\n"
        "def judged(response_text, answer, finished):\n"
        "    return Rule().bonus * float(response_text == answer)\n"
    )
    assert load_function(f"{path}:judged", "data.reward")("7", "7", True) == 1.0


def test_a_reward_has_a_time_limit_by_default():
    """rollout.reward_timeout_s is 60 s unless set, and the run's reward step holds its rewards
    to it: a reward still running past it is a RewardError (its trajectory fails) instead of
    holding the rollout for good."""
    import asyncio
    import time

    from sample import Prompt, Sample

    cfg = load_config("configs/tiny.yaml", ["run.out=/tmp/unused"])
    assert cfg.rollout.reward_timeout_s == 60.0
    cfg = load_config("configs/tiny.yaml", ["run.out=/tmp/unused", "rollout.reward_timeout_s=0.2"])

    def stuck(text, answer, finished):
        time.sleep(2)
        return 1.0

    step = rewards.Rewards(stuck, model.build_char_tokenizer(), cfg).for_rollout([Prompt([1], "1")])
    start = time.perf_counter()
    with pytest.raises(rewards.RewardError, match="longer than rollout.reward_timeout_s=0.2"):
        asyncio.run(step([Sample([1], [5], [-0.1], [1], group_id=0)]))
    assert time.perf_counter() - start < 1.5


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.lr=.nan"], "train.lr=nan: expected a finite number > 0"),
        (["train.lr=.inf"], "train.lr=inf: expected a finite number > 0"),
        (["train.grad_clip=.nan"], "train.grad_clip=nan: expected a finite number > 0"),
        (["train.clip_eps=.nan"], "train.clip_eps=nan: expected a finite number > 0"),
        (["train.tis_cap=.nan"], "train.tis_cap=nan: expected a finite number >= 0"),
        (["train.adam_beta1=1.5"], "train.adam_beta1=1.5: expected a finite number >= 0 and < 1"),
        (["rollout.temperature=.inf"], "rollout.temperature=inf: expected a finite number"),
        (["rollout.temperature=0"], "rollout.temperature=0.0: expected a finite number >= 0.01"),
        (["rollout.top_p=5"], "rollout.top_p=5.0: expected a finite number > 0 and <= 1"),
        (["rollout.mem_fraction_static=7"], "rollout.mem_fraction_static=7.0: expected"),
        (["rollout.over_sample_rate=.inf"], "rollout.over_sample_rate=inf: expected"),
        (["rollout.time_factor=.nan"], "rollout.time_factor=nan: expected a finite number > 0"),
        (["train.loss_terms={length: .nan}"], "train.loss_terms.length=nan: expected a finite"),
        (["model.num_heads=3"], "model.num_heads=3 with model.hidden_size=64"),
    ],
)
def test_every_number_is_checked_against_the_range_beside_its_field(sets, message):
    """Each of these once trained 2-3 steps before a NonFiniteError, failed every request inside
    the engine, killed the engine process or raised a raw torch traceback: now a ConfigError at
    load, naming the field and its range (config.Range, declared beside the field), before any
    model or engine exists."""
    with pytest.raises(ConfigError) as raised:
        load_config("configs/tiny.yaml", sets)
    assert str(raised.value).startswith(message), str(raised.value)


def test_a_yaml_anchor_bomb_gives_a_short_error(tmp_path):
    """A "billion laughs" as the value of a known key: nine anchored lists, each ten aliases of the
    last, 10**9 strings once expanded. PyYAML shares aliased lists, so loading is instant; the
    error quotes the value cut to one line (it was a 2 GB message)."""
    anchors = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        anchors.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    bomb = "[" + ", ".join(anchors) + "]"
    path = tmp_path / "bomb.yaml"
    for key, text in [
        ("train.lr", f"train:\n  lr: {bomb}"),
        ("rollout.tools", f"rollout:\n  tools: {bomb}"),
        ("train.loss_terms", f"train:\n  loss_terms: {bomb}"),
        ("model", f"model: {bomb}"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as raised:
            read_config(str(path))
        message = str(raised.value)
        assert message.startswith(key) and len(message) < 250 and "\n" not in message, message


def test_a_file_as_the_run_directory_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """--out naming a file (it would fail writing the first model folder, with a traceback)."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "taken").write_text("a file")
    monkeypatch.setattr(sys, "argv", ["train.py", "--out", str(tmp_path / "taken")])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "is a file, not a run directory" in stderr, stderr


def test_a_config_file_that_cannot_be_read_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """A directory given as --config, and a file that is not UTF-8: exit 2 with one line naming
    the file, no traceback (train.py's own `__main__`, run with runpy: nothing starts)."""
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("train:\n  lr: 0.1  # r\u00e9glage\n".encode("latin-1"))
    monkeypatch.chdir(ROOT)
    number = tmp_path / "number.yaml"
    number.write_text("train:\n  1: 1\n")  # a key YAML reads as a number
    cases = [(tmp_path, "Is a directory"), (latin1, "is not UTF-8 text"), (number, "key 1 is not")]
    for path, message in cases:
        monkeypatch.setattr(sys, "argv", ["train.py", "--config", str(path)])
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and message in stderr
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr


# a value other than its default for each task-specific field (task.data.TASK_FIELDS, TOOL_FIELDS)
FIELD_VALUES = {
    "data.train_path": GSM8K_TRAIN,
    "data.val_path": GSM8K_TRAIN,
    "data.hub_subset": "main",
    "data.chat_template_kwargs": "{enable_thinking: false}",
    "data.prompt_field": "question",
    "data.answer_field": "answer_text",
    "data.tiny_max_count": "5",
    "data.num_tiny_prompts": "100",
    "data.tiny_operand_digits": "3",
    "rollout.tools": "[task.tools:calculator]",
    "rollout.tool_timeout_s": "5",
    "rollout.tool_workers": "2",
    "rollout.max_observation_chars": "100",
}
TASK_SETS = {
    "tiny": [],
    "tiny_tool": ["data.task=tiny_tool"],
    "gsm8k": ["data.task=gsm8k", f"data.train_path={GSM8K_TRAIN}"],
    "chat": [
        "data.task=chat",
        f"data.train_path={GSM8K_TRAIN}",
        "data.reward=rewards:gsm8k_reward",
    ],
}  # any other task (task/reverse.py, yours): data.task=<its name> alone (`task_sets`)


def other_value(key, listed):
    """A value for `key` other than its default, as a --set string: `listed`'s, or for a flag its
    negation, for a number one its config.Range admits (twice the default, 1 or 0.5 for a zero,
    one more, one less, half); any other type needs an entry in `listed`."""
    import config as config_module

    section, name = key.split(".")
    default = getattr(getattr(config_module.Config(), section), name)
    if key in listed:
        return listed[key]
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, (int, float)):
        bounds = {k: r for k, _, r in config_module.numbers(config_module.Config())}[key]
        step = 1 if isinstance(default, int) else 0.5
        tried = [default * 2 or step, default + step, default - step, default / 2]
        admitted = [v for v in tried if v != default and bounds.admits(type(default)(v))]
        if admitted:
            return str(type(default)(admitted[0]))
    raise AssertionError(f"{key}: add a value other than its default to FIELD_VALUES")


def task_sets(task):
    return TASK_SETS.get(task, [f"data.task={task}"])


@pytest.mark.parametrize("turns", [1, 2])
@pytest.mark.parametrize("task", tasks.task_names())
def test_a_field_the_task_does_not_read_is_refused_when_set(task, turns):
    """Walking every task, with one turn and with tools' turns: each task-specific field set to a
    value but its default is accepted where the task reads it and is a ConfigError naming it
    everywhere else (the CPU demo once trained on its own reward with data.reward set)."""
    base = [f"run.out=/tmp/unused", f"rollout.max_turns={turns}", *task_sets(task)]
    if turns > 1 and not hasattr(tasks.task_module(task), "tool"):  # nothing reads the turns
        with pytest.raises(ConfigError, match=f"rollout.max_turns=2: task/{task}.py has no tool"):
            load_config(os.path.join(ROOT, "configs/tiny.yaml"), base)
        return
    read = tasks.fields_read(load_config(os.path.join(ROOT, "configs/tiny.yaml"), base))
    # the rule, said apart from the code that applies it: one turn reads no tool field, and
    # tools' turns read every field the task lists; a hub dataset's configuration is read with
    # a hub dataset only (TASK_SETS' GSM8K is a local file)
    listed = tasks.task_module(task).FIELDS - {"data.hub_subset"}
    assert read == (listed - tasks.TOOL_FIELDS if turns == 1 else listed)
    assert turns > 1 or not read & {"rollout.tools", "rollout.tool_timeout_s"}
    for key in sorted(tasks.TASK_FIELDS | tasks.TOOL_FIELDS):  # a new task's own field too
        value = other_value(key, FIELD_VALUES)
        sets = [*base, f"{key}={value}"]
        if key in read:
            load_config(os.path.join(ROOT, "configs/tiny.yaml"), sets)
        else:
            # with what a task of yours that reads it does (not the modes' READ_WHEN tables'),
            # and for a field a shipped task lists, the condition it missed
            refused = f"{key}=.* is read only by .*: list it in its FIELDS" + {
                **dict.fromkeys(tasks.TOOL_FIELDS, " and set rollout.max_turns above 1"),
                "data.hub_subset": " and read a hub dataset",
            }.get(key, r"\)$")
            with pytest.raises(ConfigError, match=refused):
                load_config(os.path.join(ROOT, "configs/tiny.yaml"), sets)
    if "data.hub_subset" in tasks.task_module(task).FIELDS:
        hub = [*base, "data.train_path=openai/gsm8k", "data.val_path=''", "data.hub_subset=main"]
        assert "data.hub_subset" in tasks.fields_read(
            load_config(os.path.join(ROOT, "configs/tiny.yaml"), hub)
        )
    # every task reads data.reward: the demo tasks too
    cfg = load_config(
        os.path.join(ROOT, "configs/tiny.yaml"), [*base, "data.reward=rewards:gsm8k_reward"]
    )
    assert cfg.data.reward == "rewards:gsm8k_reward"


def test_a_task_module_missing_what_a_task_needs_is_a_config_error():
    """task/data.check_module names what a task module lacks or gets wrong, at load, instead of
    an AttributeError later: FIELDS (missing, or naming a field that is not a task's), `reward`
    (missing, or not callable as fn(response_text, answer, finished))."""
    import types

    def module(**attributes):
        return types.SimpleNamespace(prompts=lambda *a: [], **attributes)

    good = module(FIELDS={"data.num_tiny_prompts"}, reward=tiny.reward)
    tasks.check_module("mine", good)
    tasks.check_module("mine", module(FIELDS=set(), reward=None))  # data.reward names one
    cases = {
        "needs FIELDS": module(reward=tiny.reward),
        r"FIELDS lists \['train.lr'\]": module(FIELDS={"train.lr"}, reward=tiny.reward),
        "needs `reward`": module(FIELDS=set()),
        "reward must take": module(FIELDS=set(), reward=lambda text, answer, done: 1.0),
    }
    for message, bad in cases.items():
        with pytest.raises(ConfigError, match=rf"data.task='mine' \(task/mine.py\).*{message}"):
            tasks.check_module("mine", bad)


def test_a_task_module_being_written_breaks_no_other_task(tmp_path):
    """A module of task/ that fails to import was imported by every run's check (task_names),
    so it broke data.task=tiny with an error naming no file; one without `prompts` was called
    unknown, as if its file did not exist. Now the named module alone is imported: the broken
    one is left out of the list (logged), and a module without prompts is named. (The two files
    are written into task/ itself, where a user's would be, and removed.)"""
    here = os.path.join(ROOT, "task")
    broken, misnamed = f"broken_{os.getpid()}", f"misnamed_{os.getpid()}"
    files = [os.path.join(here, f"{name}.py") for name in (broken, misnamed)]
    with open(files[0], "w") as f:
        f.write("import some_missing_dependency\n")
    with open(files[1], "w") as f:
        f.write("FIELDS = set()\nreward = None\ndef prompt(): pass\n")
    tasks.task_names.cache_clear()
    try:
        cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), [f"run.out={tmp_path}"])
        assert cfg.data.task == "tiny" and broken not in tasks.task_names()
        with pytest.raises(
            ConfigError, match=rf"task/{misnamed}.py\) is no task: it needs `prompts"
        ):
            load_config(os.path.join(ROOT, "configs/tiny.yaml"), [f"data.task={misnamed}"])
        with pytest.raises(ModuleNotFoundError, match="some_missing_dependency"):
            load_config(os.path.join(ROOT, "configs/tiny.yaml"), [f"data.task={broken}"])
    finally:
        cached = os.path.join(here, "__pycache__", f"*_{os.getpid()}.*")
        for path in files + glob.glob(cached):
            os.remove(path)
        tasks.task_names.cache_clear()
        for name in (broken, misnamed):
            sys.modules.pop(f"task.{name}", None)


def test_a_prompt_the_tokenizer_cannot_read_is_skipped_and_named(tmp_path):
    """The reverse task's letters need its CHARS in the tiny vocabulary: with a misspelt CHARS
    (here: the demo's vocabulary alone) every prompt was <unk>s, trained with no error. Now
    such prompts are counted skips, and none left a DataError that says to add them to CHARS."""
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), ["data.task=reverse"])
    good = model.build_char_tokenizer(tasks.vocabulary(cfg, model.TINY_CHARS))
    assert tasks.build_task(cfg, good).train_prompts
    without = model.build_char_tokenizer(model.TINY_CHARS)
    with pytest.raises(tasks.DataError, match="the tokenizer does not know .* the task's CHARS"):
        tasks.build_task(cfg, without)
    unknown = without.unk_token_id
    prompts = [sample.Prompt([1, 5, 2], "a"), sample.Prompt([1, unknown, 2], "b")]
    assert [p.answer for p in tasks.known(prompts, cfg.data, "train", unknown)] == ["a"]
    assert tasks.known(prompts, cfg.data, "train", None) == prompts  # byte-level: no unknown


def test_every_task_skips_prompts_over_max_prompt_len(tmp_path):
    """data.max_prompt_len holds for every task, the demo's too: longer prompts are skipped
    (counted in the log), and none left is a DataError. The demo's "<bos>N:" is 3 tokens for N
    < 10 and 4 above."""
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), [f"run.out={tmp_path}"])
    tokenizer = model.build_char_tokenizer(tasks.vocabulary(cfg, model.TINY_CHARS))
    full = tasks.build_task(cfg, tokenizer)
    assert {len(p.prompt_ids) for p in full.train_prompts} == {3, 4}
    sets = [f"run.out={tmp_path}", "data.max_prompt_len=3"]
    short = tasks.build_task(load_config(os.path.join(ROOT, "configs/tiny.yaml"), sets), tokenizer)
    assert short.train_prompts and all(int(p.answer) < 10 for p in short.train_prompts)
    expected = [p for p in full.train_prompts if len(p.prompt_ids) <= 3]
    assert [p.answer for p in short.train_prompts] == [p.answer for p in expected]
    sets = [f"run.out={tmp_path}", "data.max_prompt_len=2"]
    with pytest.raises(tasks.DataError, match="every prompt is longer than"):
        tasks.build_task(load_config(os.path.join(ROOT, "configs/tiny.yaml"), sets), tokenizer)


class Recorder:
    """A config section that records which of its fields were read."""

    def __init__(self, section):
        self._section, self.read = section, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._section, name)


@pytest.mark.parametrize("task", tasks.task_names())
def test_the_task_fields_table_is_what_build_task_reads(task, request):
    """Each task module's FIELDS (its TOOL_FIELDS only with tools' turns) is exactly what
    build_task reads of the task-specific fields, and data.reward replaces each task's own
    reward. (The small Qwen's tokenizer only for the tasks that need one: a character task's
    case waits for no build.)"""
    from transformers import AutoTokenizer

    turns = 2 if task in ("tiny_tool", "gsm8k") else 1
    sets = [f"run.out=/tmp/unused", f"rollout.max_turns={turns}", *task_sets(task)]
    sets += ["data.reward=rewards:gsm8k_reward"]
    if task == "chat":
        sets += ["data.prompt_field=question"]
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), sets)
    tokenizer = (
        AutoTokenizer.from_pretrained(request.getfixturevalue("qwen_tiny_dir"))
        if task in ("gsm8k", "chat")
        else model.build_char_tokenizer(tasks.vocabulary(cfg, model.TINY_CHARS))
    )
    data, rollout_section = Recorder(cfg.data), Recorder(cfg.rollout)
    cfg.data, cfg.rollout = data, rollout_section
    built = tasks.build_task(cfg, tokenizer)
    table = tasks.TASK_FIELDS | tasks.TOOL_FIELDS
    read = {f"data.{n}" for n in data.read} | {f"rollout.{n}" for n in rollout_section.read}
    listed = tasks.task_module(task).FIELDS
    expected = listed if turns > 1 else listed - tasks.TOOL_FIELDS
    assert read & table == expected
    assert built.reward_fn is rewards.gsm8k_reward


@pytest.mark.parametrize(
    "module", ["cancel", "loss", "advantages", "merge", "runtime.model", "update", "memory"]
)
def test_a_mode_field_set_where_its_mode_is_off_is_refused(module):
    """Each field a module reads only in some modes (its READ_WHEN), set to a value but its default
    with the mode off, is a ConfigError naming it; with the mode on it is accepted. (task.data's
    table: test_a_field_the_task_does_not_read_is_refused_when_set, above.)"""
    import importlib

    owner = importlib.import_module(module)
    turn_on = {  # a mode in which each field is read
        "rollout.drop_rate": ["rollout.cancel=count"],
        "rollout.over_sample_rate": ["rollout.cancel=count"],
        "rollout.time_quantile": ["rollout.cancel=time"],
        "rollout.time_factor": ["rollout.cancel=time"],
        "rollout.max_staleness": [
            "rollout.cancel=count",
            "rollout.drop_rate=0.25",
            "rollout.partial=true",
            "train.tis_cap=2",
        ],
        "rollout.refill_prompts": ["rollout.filter_groups=true"],
        "rollout.max_prompts_per_step": ["rollout.filter_groups=true"],
        "train.clip_eps": ["train.num_minibatches=2"],
        "train.clip_eps_high": ["train.old_logprobs=engine"],
        "train.sequence_clip_eps": [
            "train.ratio_level=sequence",
            "train.loss_agg=seq-mean-token-mean",
            "train.num_minibatches=2",
        ],
        "train.sequence_clip_eps_high": [
            "train.ratio_level=sequence",
            "train.loss_agg=seq-mean-token-mean",
            "train.num_minibatches=2",
        ],
        "train.cispo_eps_low": ["train.ratio_level=cispo", "train.num_minibatches=2"],
        "train.cispo_eps_high": ["train.ratio_level=cispo", "train.old_logprobs=engine"],
        "train.kl_estimator": ["train.kl_coef=0.1"],
        "train.scale_by_std": [],
        "rollout.merge_turns": ["rollout.max_turns=2", "data.task=tiny_tool"],
        **{key: ["model.lora_rank=4"] for key in model.READ_WHEN if ".lora_" in key},
        **{key: [] for key in model.TINY_SHAPE},  # tiny.yaml's model
        "model.trust_remote_code": ["model.path=Qwen/Qwen2.5-0.5B"],
        "model.fp32_head": ["model.compute_dtype=bfloat16"],
        "train.min_lr_ratio": [],  # tiny.yaml's schedule is cosine
        "train.fsdp_keep_gathered": ["run.nproc=2"],
        "train.shared_prefix": [],  # tiny.yaml packs
        "train.overlong_buffer": ["train.overlong_penalty=1.0"],
        "train.max_token_staleness": [
            "rollout.partial=true",
            "train.tis_cap=2",
            "rollout.cancel=count",
            "rollout.drop_rate=0.25",
        ],
        "train.micro_batch_size": ["train.max_tokens_per_micro_batch=0"],
        "rollout.max_response_tokens": ["rollout.max_turns=2", "data.task=tiny_tool"],
        "run.max_logprob_gap": [],
        "run.max_logprob_gap_steps": [],
    }
    other = {
        "train.kl_estimator": "k1",
        "train.scale_by_std": "false",
        "rollout.merge_turns": "false",
        "model.lora_alpha": "8",
        "model.lora_targets": "[q_proj,v_proj]",
        "model.lora_also_train": "[lm_head]",
        "rollout.refill_prompts": "64",
        "rollout.time_quantile": "0.5",
        "rollout.drop_rate": "0.25",
        "rollout.max_prompts_per_step": "256",
        "train.overlong_buffer": "4",
        "train.fsdp_keep_gathered": "false",
        "train.max_token_staleness": "2",
        "rollout.max_response_tokens": "100",
    }
    for key, (is_read, _) in owner.READ_WHEN.items():
        value = other_value(key, other | FIELD_VALUES)
        off = ["run.out=/tmp/unused", f"{key}={value}"]
        if key.startswith("train.clip_eps"):
            off += ["train.ratio_level=cispo"]
        if key in model.TINY_SHAPE:
            off += ["model.path=Qwen/Qwen2.5-0.5B"]
        if key == "train.min_lr_ratio":
            off += ["train.lr_schedule=constant"]
        if key == "train.fsdp_keep_gathered":
            off += ["run.nproc=1"]
        if key == "train.shared_prefix":
            off += ["train.max_tokens_per_micro_batch=0"]
        if key.startswith("run.max_logprob_gap"):
            off += ["train.old_logprobs=engine"]
        if key == "train.scale_by_std":  # read by grpo: off with any other estimator
            advantages.ESTIMATORS["other"] = advantages.grpo
            off += ["train.advantage=other"]
        try:
            assert key in turn_on, f"{key}: add a mode in which it is read to turn_on"
            cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), off[:2] + turn_on[key])
            assert is_read(cfg), key
            with pytest.raises(
                ConfigError, match=f"{key}=.* is read only .*: unset it .*READ_WHEN"
            ) as refused:
                load_config(os.path.join(ROOT, "configs/tiny.yaml"), off)
            # the --set it names (in the shell's single quotes) unsets it: the config loads
            unset = re.search(r"--set '([^']*)'", str(refused.value)).group(1)
            load_config(os.path.join(ROOT, "configs/tiny.yaml"), off + [unset])
        finally:
            advantages.ESTIMATORS.pop("other", None)


def test_print_config_shows_every_setting_and_loads_back(tmp_path, capsys):
    """`train.py --print-config` prints the run's whole config (config.py's defaults <- the file
    <- --set), starts nothing, and its output is a config that loads back to the same values."""
    import dataclasses

    import train

    args = ["--config", "configs/tiny_tool.yaml", "--set", "train.lr=0.5", "--print-config"]
    assert train.main(args) is None
    printed = capsys.readouterr().out
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    expected = load_config("configs/tiny_tool.yaml", ["train.lr=0.5"])
    again = load_config(str(path))
    assert again.train.lr == 0.5 and again.rollout.max_turns == expected.rollout.max_turns > 1
    assert dataclasses.asdict(again) == dataclasses.asdict(expected)
