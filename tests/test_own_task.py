"""Your own task: chat datasets from rows (string prompts, message lists, other field names), the
reward function a config names (start-up errors named before the engine starts, run-time failures
counted and kept out, too many of them a named error), GSM8K through the same path, and the
Countdown example (its reward on hand-checked equations, its config running on CPU)."""

import json
import math
import os
import re
import sys

import pytest
from transformers import AutoTokenizer

import sample
import task.data as tasks
import task.gsm8k as gsm8k
import task.chat as chat
import rewards
from config import ConfigError
from assemble import load_config
from conftest import GSM8K_TRAIN, REPO, scratch
from test_gpu_readiness import CPU_SIZES
from test_train import scalars

sys.path.insert(0, os.path.join(REPO, "examples", "countdown"))
from reward import FORMAT_CREDIT, countdown_reward  # noqa: E402

ROWS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "Name a prime.", "answer": 7}]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def rendered(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_chat_rows_render_like_hand_built_chat_prompts(qwen_tiny_dir, tmp_path):
    """Chat rows (a string prompt, or a message list under other field names) become exactly the
    token ids of the chat template applied by hand; a number answer becomes text."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tiny_dir)
    strings = chat.chat_prompts(tokenizer, write_jsonl(tmp_path / "a.jsonl", ROWS), "train", 256)
    messages = [
        {
            "question": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": r["prompt"]},
            ],
            "gold": r["answer"],
        }
        for r in ROWS
    ]
    lists = chat.chat_prompts(
        tokenizer,
        write_jsonl(tmp_path / "b.jsonl", messages),
        "train",
        256,
        prompt_field="question",
        answer_field="gold",
    )
    assert [p.prompt_ids for p in strings] == [
        rendered(tokenizer, [{"role": "user", "content": r["prompt"]}]) for r in ROWS
    ]
    assert [p.prompt_ids for p in lists] == [rendered(tokenizer, m["question"]) for m in messages]
    # a number answer as text
    assert [p.answer for p in strings] == [p.answer for p in lists] == ["5", "7"]


def test_malformed_chat_rows_are_counted_and_skipped(qwen_tiny_dir, tmp_path, caplog):
    """Unparseable lines and rows with a missing or ill-typed prompt or answer are skipped and
    counted; a file with no usable row is a DataError."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tiny_dir)
    bad = [
        "not json",
        {"prompt": "no answer"},
        {"prompt": [{"role": "user"}], "answer": "1"},
        {"prompt": 3, "answer": "1"},
        {"prompt": "ok", "answer": True},
    ]
    prompts = chat.chat_prompts(
        tokenizer, write_jsonl(tmp_path / "rows.jsonl", ROWS + bad), "train", 256
    )
    assert (
        len(prompts) == 2
        and "skipped 4 malformed rows" in caplog.text
        and "skipped 1 unparseable" in caplog.text
    )
    with pytest.raises(tasks.DataError, match="no usable prompts"):
        chat.chat_prompts(tokenizer, write_jsonl(tmp_path / "bad.jsonl", bad), "train", 256)


def test_half_characters_huge_floats_and_a_misnamed_field(qwen_tiny_dir, tmp_path, caplog):
    """A reviewer's rows: a prompt or answer holding half a character (JSON's "\\ud83d", an emoji
    cut) crashed the whole load in the tokenizer with a TypeError naming no row; it is a counted
    skip. An integral float past 2**53 was its rounding error as digits (6.02e23 ->
    601999999999999995805696); it stays a float's text. And a misnamed prompt field warned once
    per row (20,001 lines) and ended in a DataError that did not say why: five rows are warned
    of, the rest counted, and the DataError names the first row's problem."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tiny_dir)
    rows = ROWS + [
        {"prompt": "an emoji cut in half: \ud83d", "answer": "1"},
        {"prompt": "fine", "answer": "x\ud83d"},
        {"prompt": "big", "answer": 6.02e23},
        {"prompt": "exact", "answer": 2.0**52},
    ]
    prompts = chat.chat_prompts(tokenizer, write_jsonl(tmp_path / "rows.jsonl", rows), "train", 256)
    assert [p.answer for p in prompts] == ["5", "7", "6.02e+23", str(2**52)]
    assert "skipped 2 malformed rows" in caplog.text and "lone surrogate" in caplog.text
    caplog.clear()
    misnamed = [{"question": f"q{i}", "answer": "1"} for i in range(50)]
    with pytest.raises(tasks.DataError, match="the first malformed: row 1: needs a string"):
        chat.chat_prompts(tokenizer, write_jsonl(tmp_path / "q.jsonl", misnamed), "train", 256)
    assert caplog.text.count("skipping malformed row") == chat.MAX_ROW_WARNINGS == 5
    assert "skipped 50 malformed rows (the first 5 said)" in caplog.text


def test_rows_as_pandas_and_editors_write_them(qwen_tiny_dir, tmp_path, caplog):
    """What a fresh reader's messy files did: a byte-order mark cost the first row, blank lines
    were counted as bad rows, bytes that are not UTF-8 became U+FFFD inside the text, NaN and
    Infinity answers were the text "nan" and "inf", ints stored as floats (pandas, with one
    missing value) were "5.0", and a long answer (a code task's tests) skipped its row. Now: BOM
    and blank lines are not rows, the other three are counted skips, integral floats read as
    ints, only the prompt has a length limit; a .JSONL loads, a .json or an empty .parquet file
    is a DataError naming it (the hub was asked, or pyarrow's error came raw)."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tiny_dir)
    lines = [json.dumps({"prompt": "a", "answer": 5.0}), "", "  "]
    lines += [json.dumps({"prompt": "b", "answer": float(v)}) for v in ("nan", "inf")]
    lines += [json.dumps({"prompt": "c", "answer": "t" * 20_000})]
    path = tmp_path / "ROWS.JSONL"
    path.write_bytes(
        b"\xef\xbb\xbf" + "\n".join(lines).encode() + b'\n{"prompt": "caf\xe9", "answer": "1"}\n'
    )
    prompts = chat.chat_prompts(tokenizer, str(path), "train", 256)
    assert [p.answer for p in prompts] == ["5", "t" * 20_000]
    assert "skipped 1 unparseable rows of 5" in caplog.text  # the non-UTF-8 line
    assert "skipped 2 malformed rows" in caplog.text  # NaN and Infinity
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "empty.parquet").write_bytes(b"")
    for name, message in (("rows.json", "must be a .jsonl or"), ("empty.parquet", "as parquet")):
        with pytest.raises(tasks.DataError, match=message):
            chat.chat_prompts(tokenizer, str(tmp_path / name), "train", 256)
    folder = tmp_path / "dataset"  # a folder of data files still goes to `datasets`
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS)
    assert len(chat.chat_prompts(tokenizer, str(folder), "train", 256)) == len(ROWS)


def test_gsm8k_is_a_chat_dataset_with_the_same_prompts_and_rewards(qwen_tiny_dir):
    """GSM8K through the chat path: every row's question and instruction rendered by the chat
    template, the answer after "####", and full reward for that answer."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tiny_dir)
    prompts = gsm8k.read(tokenizer, GSM8K_TRAIN, "train", 512)
    rows = chat.read_rows(GSM8K_TRAIN, "train")
    assert len(prompts) == len(rows) == 100
    # what the GSM8K loader built before it became a chat dataset
    for prompt, row in zip(prompts, rows):
        assert prompt.prompt_ids == rendered(
            tokenizer,
            [{"role": "user", "content": f"{row['question']}\n{gsm8k.INSTRUCTION}"}],
        )
        assert prompt.answer == row["answer"].rsplit("####", 1)[1].strip()
        response = f"so #### {prompt.answer}"
        assert rewards.call_reward(rewards.gsm8k_reward, response, prompt.answer, True) == 1.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("''", "data.task=chat needs data.reward"),
        ("no_colon", "expected 'path/to/file.py:function'"),
        ("examples/countdown/missing.py:countdown_reward", "no file"),
        ("examples/countdown/reward.py:nope", "has no function 'nope'"),
        ("rewards:parse_number", "must take (response_text, answer, finished)"),
        ("no_such_module_xyz:fn", "cannot import"),
    ],
)
def test_reward_errors_are_named_at_start_up(tmp_path, spec, message):
    """A bad data.reward (missing, malformed, no such file, function or module, the wrong
    signature) is a ConfigError naming it when the task is built, before any engine starts."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg = load_config(
            "configs/tiny.yaml",
            ["data.task=chat", f"data.train_path={GSM8K_TRAIN}", f"data.reward={spec}"],
        )
        tasks.build_task(cfg, None)


def test_a_reward_file_that_cannot_load_is_named_before_the_model_loads(tmp_path, monkeypatch):
    """A reward file with a syntax error, a missing import, or a raise (even SystemExit) at load
    was a raw traceback, after the model loaded: now a ConfigError naming data.reward, raised
    while the task is built, before any model (build_policy is made to fail here to show it),
    with the file and line it raised at. A helper module beside the file imports (its folder was
    not importable)."""
    import assemble

    files = {
        "syntax.py": ("def f(:\n", "SyntaxError"),
        "missing.py": ("import no_such_module_xyz\n", "No module named 'no_such_module_xyz'"),
        "raises.py": ("raise RuntimeError('needs OPENAI_API_KEY')\n", "needs OPENAI_API_KEY"),
        # the user's line, not the library's that raised (json/decoder.py)
        "uses_json.py": ("import json\n\nDATA = json.loads('{')\n", "uses_json.py:3 (raised in "),
        # where it raised: a helper module the file imports (a bare KeyError named neither)
        "uses_broken.py": (
            "import broken_beside\n",
            f"KeyError: 'b', at {tmp_path}/broken_beside.py:2",
        ),
        "exits.py": ("raise SystemExit('bad config')\n", "SystemExit: bad config"),
    }
    (tmp_path / "broken_beside.py").write_text("TABLE = {'a': 1}\nVALUE = TABLE['b']\n")
    for name, (text, message) in files.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            rewards.load_reward(f"{tmp_path / name}:f")
    (tmp_path / "helpers_beside.py").write_text("BONUS = 0.5\n")
    (tmp_path / "uses_helper.py").write_text(
        "import helpers_beside\n\n\ndef f(response_text, answer, finished):\n"
        "    return helpers_beside.BONUS\n"
    )
    assert rewards.load_reward(f"{tmp_path}/uses_helper.py:f")("x", "1", True) == 0.5
    # an installed package's module spec, failing inside the standard library: the package's
    # line too (site-packages sits inside the standard library's folder, as here)
    import config

    stdlib, packages = tmp_path / "lib", tmp_path / "lib" / "site-packages"
    (packages / "zz_installed").mkdir(parents=True)
    (stdlib / "zz_stdthing.py").write_text("def boom():\n    raise ValueError('deep')\n")
    (packages / "zz_installed" / "__init__.py").write_text(
        "import zz_stdthing\nzz_stdthing.boom()\n"
    )
    paths = {"stdlib": stdlib, "platstdlib": stdlib, "purelib": packages, "platlib": packages}
    monkeypatch.setattr(
        config.sysconfig, "get_paths", lambda: {k: str(v) for k, v in paths.items()}
    )
    monkeypatch.syspath_prepend(str(stdlib))
    monkeypatch.syspath_prepend(str(packages))
    with pytest.raises(ConfigError) as refused:
        rewards.load_reward("zz_installed:f")
    assert str(refused.value).endswith(
        f"(ValueError: deep, at {packages}/zz_installed/__init__.py:2 (raised in "
        f"{stdlib}/zz_stdthing.py:2))"
    )
    monkeypatch.setattr(assemble, "build_policy", lambda *args: pytest.fail("the model loaded"))
    sets = [f"data.train_path={GSM8K_TRAIN}", f"data.reward={tmp_path}/raises.py:f"]
    cfg = load_config("configs/tiny.yaml", ["data.task=chat", f"run.out={tmp_path}/run", *sets])
    with pytest.raises(ConfigError, match="needs OPENAI_API_KEY"):
        assemble.setup(cfg)


def test_an_awaitable_reward_is_awaited_or_named():
    """An object whose __call__ is `async def` is awaited like an `async def` function (it ran in
    a thread and every trajectory failed on its unawaited coroutine); a plain function returning
    a coroutine is a RewardError saying what to change."""
    import asyncio

    class AsyncReward:
        async def __call__(self, response_text, answer, finished):
            return 1.0

    def returns_a_coroutine(response_text, answer, finished):
        return AsyncReward()(response_text, answer, finished)

    assert rewards.is_async(AsyncReward()) and not rewards.is_async(returns_a_coroutine)
    called = rewards.call_reward_off_loop(AsyncReward(), "x", "1", True, pool=None)
    assert asyncio.run(called) == 1.0
    with pytest.raises(rewards.RewardError, match="returned an awaitable"):
        rewards.call_reward(returns_a_coroutine, "x", "1", True)


def test_a_file_reward_and_a_module_reward_load():
    """data.reward loads a function from a file (path/to/file.py:function) or from an importable
    module (module:function)."""
    loaded = rewards.load_reward("examples/countdown/reward.py:countdown_reward")
    assert loaded.__name__ == "countdown_reward"  # the named function, from that file
    row = '{"target": 3, "numbers": [1, 2]}'
    assert [loaded(text, row, True) for text in ("x", "<answer>1 + 2</answer>")] == [0.0, 1.0]
    assert rewards.load_reward("rewards:gsm8k_reward") is rewards.gsm8k_reward


def flaky_reward(fails):
    """A reward given the trajectory id as its text: raises, returns NaN or a string where
    `fails(id)` says."""

    def fn(response_text, answer, finished):
        trajectory_id = int(response_text)
        if fails(trajectory_id):
            return [lambda: 1 / 0, lambda: math.nan, lambda: "high"][trajectory_id % 3]()
        return 1.0

    return lambda turns: rewards.call_reward(fn, str(turns[-1].trajectory_id), "answer", True)


def test_failing_rewards_are_counted_and_kept_out_and_too_many_stop_the_run(engine):
    """A reward that raises, returns NaN or returns a string fails its trajectory: counted,
    aborted as a reward error (not an engine failure) and scored 0; failures on more than
    rollout.max_failed_ratio of the trajectories raise a RewardError."""
    prompts = [[1, 5, 12], [1, 6, 4, 12]] * 4  # 64 trajectories: 3 failures are under 10%
    samples, stats = engine.generate(prompts, 8, 1.0, 8, reward=flaky_reward(lambda i: i < 3))
    trajectories = sample.trajectories_of(samples)
    assert stats.num_reward_errors == 3 and engine.num_in_flight() == 0
    assert stats.num_failed == 0  # the engine failed nothing
    for turns in trajectories:
        failed = turns[-1].trajectory_id < 3
        assert (turns[-1].masked, turns[-1].finish_reason == "reward_error") == (failed, failed)
        assert turns[-1].reward == (0.0 if failed else 1.0)
    with pytest.raises(rewards.RewardError, match="failed on 32/64 trajectories"):
        engine.generate(prompts, 8, 1.0, 8, reward=flaky_reward(lambda i: i % 2 == 0))
    assert engine.num_in_flight() == 0


TARGET_24 = json.dumps({"target": 24, "numbers": [3, 4, 8, 2]})


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer>(8 - 4) * 3 * 2</answer>", 1.0),  # 24, each number once
        (
            "<answer>(8 - 4) * 3 * 2 = 24</answer>",
            1.0,
        ),  # "= 24" tolerated: the left side is checked
        # the last answer counts
        ("first <answer>1</answer> then <answer>2 * 3 * (8 - 4)</answer>", 1.0),
        ("<answer>(4 - 2) * 8 + 3</answer>", FORMAT_CREDIT),  # the right numbers, 19
        ("<answer>(8 / 4 + 2) * 3</answer> wait", FORMAT_CREDIT),  # 12
        ("<answer>8 * 3 + 4 - 2 - 2</answer>", FORMAT_CREDIT),  # 2 reused
        ("<answer>8 * 3</answer>", FORMAT_CREDIT),  # 4 and 2 missing
        ("<answer>(8 - 4) * 3 * 2 + 0</answer>", FORMAT_CREDIT),  # 0 was not given
        ("<answer>8 / (4 - 4) * 3 * 2</answer>", FORMAT_CREDIT),  # 4 twice (and a division by zero)
        # numbers missing: never evaluated
        ("<answer>" + "(" * 30 + "8" + ")" * 30 + "</answer>", FORMAT_CREDIT),
        ("(8 - 4) * 3 * 2", 0.0),  # no <answer> tags
        ("<answer></answer>", 0.0),
        ("<answer>(8 - 4) ** 3 * 2</answer>", 0.0),  # not one of the four operations
        ("<answer>(8 - 4) * 3 * 2.0</answer>", 0.0),  # no decimals
        # hostile: rejected by character, never run
        ("<answer>__import__('os').system('true')</answer>", 0.0),
    ],
)
def test_countdown_reward_on_hand_checked_equations(response, expected):
    """Countdown's reward: 1 when the last <answer> holds an equation that uses each given number
    once and reaches the target, format credit when it is well formed but wrong, 0 without tags,
    for other operators, decimals or hostile text."""
    assert countdown_reward(response, TARGET_24, True) == expected


def test_countdown_reward_divides_exactly():
    """Division is exact (6 / 3 reaches 2), and a division by zero earns format credit only."""
    row = json.dumps({"target": 2, "numbers": [6, 3]})
    assert countdown_reward("<answer>6 / 3</answer>", row, True) == 1.0
    assert (
        countdown_reward(
            "<answer>6 / (3 / 0)</answer>", json.dumps({"target": 2, "numbers": [6, 3, 0]}), True
        )
        == FORMAT_CREDIT
    )


COUNTDOWN_RUN = scratch("countdown")
COUNTDOWN_SETS = [s for s in CPU_SIZES if not s.startswith("data.")] + [
    f"data.train_path={COUNTDOWN_RUN}/train.jsonl",
    f"data.val_path={COUNTDOWN_RUN}/test.jsonl",
    "data.num_val_prompts=4",
    f"model.path={COUNTDOWN_RUN}/qwen3_moe",
    "rollout.max_new_tokens=32",
    "run.nproc=1",
    "train.compile=false",  # the GSM8K rehearsals compile on CPU already (tests/test_gpu_readiness)
    "run.check_weights_every=1",
    "train.routing_replay=true",  # the engine's routes replayed in the update (runtime/routing.py)
    "train.shared_prefix=true",  # each group's prompt computed once in the update, routes and all
]
COUNTDOWN_COMMAND = " ".join(
    [
        sys.executable,
        "examples/countdown/make_data.py",
        "--out",
        COUNTDOWN_RUN,
        "--train",
        "64",
        "--test",
        "8",
        "&&",
        sys.executable,
        "bench/families.py",
        "--build",
        "qwen3_moe",
        "--folder",
        f"{COUNTDOWN_RUN}/qwen3_moe",
        "&&",
        sys.executable,
        "train.py",
        "--config",
        "examples/countdown.yaml",
        "--out",
        f"{COUNTDOWN_RUN}/run",
        *[f"--set {item}" for item in COUNTDOWN_SETS],
    ]
)


@pytest.mark.background("countdown", ["bash", "-c", COUNTDOWN_COMMAND])
def test_the_countdown_example_trains_on_cpu(background_runs):
    """examples/countdown.yaml, 2 steps on one rank (its own engine, in the background): data
    generated, reward loaded from its file, every trajectory scored or counted. The model is
    another family than the other rehearsals' Qwen2: a random Qwen3 mixture of experts
    (bench/families.py: Qwen3's head_dim that is not hidden / heads and q and k norms, 4 experts
    in one 3D tensor per layer, pushed one tensor per expert as its checkpoint holds them), each
    weight push checked bit for bit. With routing replay: every trained sequence came with the
    engine's routes, in the packed rows the trainer's own routers agree with nearly all of them
    (tests/test_routing.py: routes one token off agree on 0.15), and the engine's log-probs
    match the trainer's. With the prompt shared (train.shared_prefix): its routes are the
    first sample's, and the agreement and the gap say they sit where the model reads them."""
    # the run's last line says where to look next
    assert background_runs.lines("countdown")[-1].startswith(f"done: {COUNTDOWN_RUN}/run (tensorb")
    # as shipped for a GPU (the run above overrides them for CPU): the GSM8K configs' micro-batch
    # budget, compile and attention, and TinyZero's 1,024 new tokens
    cfg = load_config("examples/countdown.yaml", [])
    assert (cfg.train.max_tokens_per_micro_batch, cfg.train.compile) == ("auto", True)
    assert (cfg.model.attn_implementation, cfg.rollout.max_new_tokens) == ("flex_attention", 1024)
    logged = scalars(os.path.join(COUNTDOWN_RUN, "run"))
    assert len(logged["train/reward_mean"]) == 2 and "val/reward_mean" in logged
    assert logged["rollout/reward_errors"] == [0, 0]
    assert len(logged["timing/check_weights_s"]) == 2  # every push checked, none refused
    assert logged["train/unrouted_sequences"] == [0, 0]
    assert min(logged["train/route_agreement"]) > 0.98
    assert max(logged["train/logprob_gap"]) < 0.01
    # the prompts shared: at most (group_size - 1) of every group's prompt but one token saved
    assert all(saved > 0 for saved in logged["train/shared_prefix_tokens"])
