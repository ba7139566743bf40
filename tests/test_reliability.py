"""Reliability: faults injected into the real engine and the trainer, hostile input, and the
security rules. Each test breaks one guarantee on purpose and checks the named error, the counted
skip, or that nothing hangs and nothing is lost (README "Guarantees" lists them)."""

import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
import tokenize
import types
import typing

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

import loss as losses
import runtime.checkpoint as checkpoint
import runtime.model as model
import task.data as tasks
import task.gsm8k as gsm8k
import task.tools as tools
import train
import update
from advantages import ESTIMATORS, group_advantages
from advantages import compute as compute_advantages
from config import Config, ConfigError, numbers
from conftest import scratch, tiny_config, train_on
from metrics import summed
from runtime.engine import StopSignal
from assemble import load_config
from test_config_and_tasks import _wide_char_tokenizer, qwen_tool_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- hostile input
def every_field(config=None, prefix=""):
    """(dotted key, type) of every leaf of the config tree."""
    config = config or Config()
    for field in dataclasses.fields(config):
        kind = typing.get_type_hints(type(config))[field.name]
        if dataclasses.is_dataclass(kind):
            yield from every_field(getattr(config, field.name), f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", kind


HOSTILE_VALUES = [
    "",
    "abc",
    "[1, 2]",
    "{a: 1}",
    "null",
    "-1",
    "0",
    "-0.5",
    "1e309",
    ".nan",
    "-.inf",
    "99999999999999999999",
    "true",
    "1.5",
    "'; rm -rf /'",
]


def test_config_fuzzing_gives_a_config_or_a_config_error():
    """Every field x hostile value (wrong types, negatives, zeros, NaN, inf, huge): the only
    outcomes are a valid config or a ConfigError naming the key; never another exception."""
    tried = rejected = 0
    for key, _ in every_field():
        for value in HOSTILE_VALUES:
            tried += 1
            try:
                cfg = load_config("configs/tiny.yaml", [f"{key}={value}"])
            except ConfigError as e:
                rejected += 1
                assert key.split(".")[-1] in str(e) or "not a valid YAML" in str(e), (
                    key,
                    value,
                    str(e),
                )
                continue
            for k, v, allowed in numbers(cfg):  # accepted: every number in its range
                assert allowed.admits(v), (key, value, k, v)
    assert tried > 700 and rejected > tried // 2


# partial rollout on the CPU demo
PARTIAL = [
    "rollout.cancel=count",
    "rollout.drop_rate=0.25",
    "rollout.partial=true",
    "train.tis_cap=2",
]


@pytest.mark.parametrize(
    "sets, message",
    [
        (["rollout.prompts_per_step=0"], "rollout.prompts_per_step=0: expected an integer >= 1"),
        (["train.micro_batch_size=-4"], "train.micro_batch_size=-4"),
        (["train.lr=0"], "train.lr=0.0"),
        (["rollout.temperature=.nan"], "rollout.temperature=nan"),
        (
            ["rollout.partial=true"],
            "rollout.partial=true suspends cancelled samples, but rollout.cancel=none",
        ),
        (  # resumed tokens trained as if the weights being trained sampled them (a reviewer's)
            PARTIAL[:-1],
            "rollout.partial trains resumed tokens that older weights sampled: correct them",
        ),
        (  # without TIS a bound > 0 leaves tokens up to that many versions old uncorrected
            PARTIAL[:-1] + ["train.max_token_staleness=1"],
            "or mask them with train.max_token_staleness=0",
        ),
        (
            ["rollout.drop_rate=0.2", "rollout.over_sample_rate=0.2", "rollout.cancel=count"],
            "rollout.drop_rate=0.2 with rollout.over_sample_rate=0.2: set one, not both",
        ),
        (["rollout.group_size=1"], "rollout.group_size=1: expected an integer >= 2"),
        (["train.kl_in=reward"], "train.kl_in=reward needs train.kl_coef > 0"),
        (["train.tis_cap=0.5"], "train.tis_cap=0.5"),
        (["data.task=gsm8k"], "needs data.train_path"),
        (["model.dtype=bfloat16"], "was replaced by"),
        (["model.lora_dropout=0.05"], "lora_dropout' was removed: dropout makes"),
        (
            ["train.ratio_level=sequence"],
            "it needs train.loss_agg=seq-mean-token-mean, not 'token-mean'",
        ),
        (
            ["train.ratio_level=seq"],
            "train.ratio_level='seq': expected one of ('token', 'sequence', 'cispo')",
        ),
        (["train.clip_eps_high=-0.1"], "train.clip_eps_high=-0.1: expected a finite number >= 0"),
        (
            ["train.ratio_level=cispo", "train.loss_agg=seq-mean-token-sum"],
            "train.ratio_level=cispo normalises over every token",
        ),
        (
            [
                "train.loss_terms={kl: 0.1}"
            ],  # passed the load, then found no reference at the update
            "train.loss_terms: 'kl' is set by train.kl_coef (with train.kl_in=loss), not here",
        ),
        (["train.loss_terms={entropy: 0.1}"], "'entropy' is set by train.entropy_coef"),
        (
            ["rollout.cancel=time", "rollout.filter_groups=true"],
            "rollout.cancel='time' with rollout.filter_groups: there the kept groups decide the "
            "stop",  # time would run as count, its own fields unread
        ),
        (
            ["data.reward=nowhere.py:score"],  # was found only by setup, after --print-config
            "data.reward='nowhere.py:score': no file nowhere.py",
        ),
        (
            ["data.task=chat", "rollout.max_turns=2", "rollout.tools=[nowhere.py:add]"],
            "rollout.tools='nowhere.py:add': no file nowhere.py",
        ),
        (
            ["rollout.cancel=count", "rollout.time_quantile=0.5"],
            "rollout.time_quantile=0.5 is read only by rollout.cancel=time",
        ),
        (
            ["train.old_logprobs=engine", "train.num_minibatches=2", "train.tis_cap=2"],
            "turn off: train.num_minibatches > 1 (later minibatches need pi_old, not the weights "
            "now); train.tis_cap",
        ),
        (  # a resumed token's TIS weight was off by up to 1 / top_p (its nucleus mass unknown)
            PARTIAL + ["rollout.top_p=0.9", "train.tis_cap=2"],
            "train.tis_cap with rollout.partial and rollout.top_p < 1: a resumed token's TIS "
            "weight needs the nucleus mass",
        ),
        (  # no token is older than the weights being trained: nothing read it
            ["train.max_token_staleness=2"],
            "train.max_token_staleness=2 is read only with partial rollout",
        ),
        (
            PARTIAL[:2]
            + ["rollout.partial=true", "rollout.max_staleness=0"]
            + ["train.max_token_staleness=2"],  # max_staleness 0: plain dropping
            "train.max_token_staleness=2 is read only with partial rollout",
        ),
        (  # the batch's whole: it waited for every request, as cancel=none
            ["rollout.cancel=count"],
            "rollout.cancel=count cuts nothing without rollout.drop_rate, rollout.over_sample",
        ),
        (  # one minibatch, pi_old the update's own forward: the ratio is 1, never clipped
            ["train.clip_eps_high=0.28"],
            "train.clip_eps_high=0.28 is read only with train.ratio_level=token and a ratio that "
            "can leave 1",
        ),
        (["train=1"], "train: expected a mapping, got 1"),  # was "train.:"
        (  # the working directory's own checkpoints/ and model/, then a traceback at the logger
            ["run.out=''"],
            "run.out='': expected a path",
        ),
        (  # one turn never exceeds max_new_tokens (48): the budget stayed 48
            ["rollout.max_response_tokens=100"],
            "rollout.max_response_tokens=100 is read only with tools' turns",
        ),
        (  # the engine continues one request: every cancelled trajectory was dropped
            PARTIAL + ["data.task=tiny_tool", "rollout.max_turns=2"],
            "rollout.partial=true with rollout.max_turns=2: partial rollout resumes single-turn",
        ),
    ],
)
def test_impossible_configs_name_the_problem(sets, message):
    """Values out of range and contradictory settings are ConfigErrors that name the key and the
    problem."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.yaml", sets)


def test_an_out_on_the_command_line_is_the_folder_as_written():
    """`--out ""` was skipped (`if args.out`): the run wrote to the config's folder instead. A
    reviewer found --out read as a YAML value: `runs/exp #2` cut to `runs/exp` (a --resume then
    resumed that other run), `2026` an int, `~` None. A '#' that YAML would read as a comment in a
    --set is refused."""
    with pytest.raises(ConfigError, match="run.out='': expected a path"):
        train.config_of(train.parse_args(["--config", "configs/tiny.yaml", "--out", ""]))
    odd = ("a\x85b", "a \u2028 b", "del\x7f", "surr\udcff", "tab\tnl\n", " é😀 ", "-")
    for out in ("runs/exp #2", "2026", "~", "runs/a: b", "@home/run", 'runs/"x" \\y', *odd):
        assert train.config_of(train.parse_args(["--out", out])).run.out == out
    with pytest.raises(ConfigError, match="starts a YAML comment, which cut the value to 'data/x'"):
        load_config(None, ["data.train_path=data/x #1.jsonl"])
    assert load_config(None, ['run.out="runs/exp #2"']).run.out == "runs/exp #2"
    # the refusal's advice, pasted into a shell, reads back exactly (readers found plain quotes
    # turning a backslash into an escape or folding a line break, and the form unquoted for the
    # shell)
    for path in ("data\\runs #1", "it's #1", 'say "hi" #1', "a\nb #1", "$HOME `x` #1"):
        with pytest.raises(ConfigError) as refused:
            load_config(None, [f"run.out={path}"])
        [pasted] = shlex.split(re.search(r"\(--set (.*)\), else", str(refused.value))[1])
        assert load_config(None, [pasted]).run.out == path
    assert load_config(None, ["run.out=runs/exp#2"]).run.out == "runs/exp#2"  # no comment


def test_a_cancel_policy_cut_only_by_the_rollout_timeout_loads():
    """At rollout.rollout_timeout_s the group policy keeps complete groups only and partial
    rollout resumes the cut samples (cancel.decide): read with no rate, so not refused."""
    timeout = ["rollout.rollout_timeout_s=60"]
    assert load_config("configs/tiny.yaml", ["rollout.cancel=group", *timeout]).rollout.cancel
    sets = ["rollout.cancel=count", "rollout.partial=true", "train.tis_cap=2", *timeout]
    assert load_config("configs/tiny.yaml", sets).rollout.resumes()


def test_the_ways_out_of_a_refused_nucleus_tis_load():
    """Partial rollout with top_p < 1 and TIS loads with older tokens masked, with or without
    TIS; without TIS and unmasked they would train uncorrected, refused."""
    nucleus = PARTIAL + ["rollout.top_p=0.9"]
    masked = ["train.max_token_staleness=0"]
    for way_out in (["train.tis_cap=2", *masked], ["train.tis_cap=0", *masked]):
        assert load_config("configs/tiny.yaml", nucleus + way_out).rollout.resumes()
    with pytest.raises(ConfigError, match="correct them with train.tis_cap"):
        load_config("configs/tiny.yaml", nucleus + ["train.tis_cap=0"])


def test_hostile_dataset_rows_are_counted_and_skipped(tmp_path, caplog):
    """Hostile rows (not JSON, wrong types, missing fields, a huge field, an over-long prompt,
    invalid UTF-8) are skipped and counted by kind; only the good rows load, and a file with
    nothing usable is a DataError."""
    path = tmp_path / "rows.jsonl"
    good = {"question": "What is 2 + 3?", "answer": "#### 5"}
    hostile = [
        json.dumps(good),
        "{not json",
        json.dumps({"question": 1, "answer": "#### 1"}),
        "[]",
        "null",
        json.dumps({"answer": "#### 2"}),
        json.dumps({"question": "q", "answer": ["#### 3"]}),
        # a huge field: never tokenized
        json.dumps({"question": "x" * 100_000, "answer": "#### 4"}),
        # over the prompt limit once tokenized
        json.dumps({"question": "y " * 400, "answer": "#### 6"}),
        "\udcff\udcfe garbage",
        json.dumps(good),
    ]
    path.write_text("\n".join(hostile), errors="surrogateescape")
    prompts = gsm8k.read(_wide_char_tokenizer(), str(path), "train", max_prompt_len=512)
    assert [p.answer for p in prompts] == ["5", "5"]
    assert "skipped 2 unparseable rows of 11" in caplog.text
    assert (
        "skipped 6 malformed rows" in caplog.text
        and "skipped 1 prompts longer than 512" in caplog.text
    )
    path.write_text("{not json\n[]\n")
    with pytest.raises(tasks.DataError, match="no usable prompts"):
        gsm8k.read(_wide_char_tokenizer(), str(path), "train", max_prompt_len=512)


def test_a_tokenizer_without_chat_template_is_a_named_error(tmp_path):
    """GSM8K prompts with a tokenizer that has no chat template are a DataError saying so."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}))
    with pytest.raises(tasks.DataError, match="no chat template"):
        gsm8k.read(model.build_char_tokenizer(), str(path), "train", max_prompt_len=512)


def test_tool_call_fuzzing_through_the_qwen_json_adapter(tmp_path):
    """Random and adversarial model-written calls: each gives an observation (an answer or an error
    text) or None (no call), every adversarial one an error; the calculator never raises and never
    evaluates code (a call that would run a shell command leaves no file behind)."""
    tokenizer = qwen_tool_tokenizer()
    tool = tools.QwenTools(tokenizer, [tools.calculator])
    marker = tmp_path / "pwned"
    arguments = [
        '{"expression": "9**9**9**9"}',
        '{"expression": "(" * 5000}',
        "{\"expression\": \"__import__('os').system('touch %s')\"}" % marker,
        '{"expression": "1/0"}',
        '{"expression": "' + "1+" * 20000 + '1"}',
        '{"expression": [1, 2]}',
        "null",
        '{"expression": "0x1p1023 * 2"}',
        '{"expression": "1e308*10"}',
    ]
    adversarial = ['{"name": "calculator", "arguments": %s}' % a for a in arguments]
    adversarial += ["[]", '"str"', "{" * 3000]
    rng = random.Random(0)
    alphabet = '0123456789+-*/(). e"{}[]:,abcxyz_\\'
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(300)]
    for i, body in enumerate(adversarial + fuzz):
        ids = tokenizer(f"<tool_call>{body}</tool_call>", add_special_tokens=False).input_ids
        observation = asyncio.run(tool(ids))
        text = tokenizer.decode(observation.ids)
        assert "<tool_response>" in text
        if i < len(adversarial):  # each adversarial call refused with an error text
            assert observation.is_error and "error" in text, body[:80]
    assert not marker.exists()


# ---------------------------------------------------------------- security
def project_files():
    """Every .py file of the repository: its hidden folders and cpu_compat/ (SGLang's CPU
    patches) left out, wherever the repository itself lives (a hidden parent folder included)."""
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "cpu_compat"]
        yield from (os.path.join(root, f) for f in files if f.endswith(".py"))


PROJECT_FILES = list(project_files())


def calls(code, opening):
    """The text of every call that starts with `opening`, up to its matching parenthesis."""
    for match in re.finditer(re.escape(opening), code):
        depth, end = 0, match.start()
        for end in range(match.end() - 1, len(code)):
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            if depth == 0:
                break
        yield code[match.start() : end + 1]


def test_no_eval_exec_or_unsafe_loading_anywhere():
    """No eval/exec in the code; nothing unpickled but through an Unpickler whose find_class
    admits a list (runtime/parallel.py's, for checkpoint metadata); every torch.load reads
    weights only; remote code stays off."""
    assert os.path.join(REPO, "train.py") in PROJECT_FILES and len(PROJECT_FILES) > 50
    for path in PROJECT_FILES:
        with open(path, "rb") as f:  # tokens, not text: strings and comments may name what we avoid
            tokens = [
                t for t in tokenize.tokenize(f.readline) if t.type in (tokenize.NAME, tokenize.OP)
            ]
        for before, name, after in zip(tokens, tokens[1:], tokens[2:]):
            is_builtin_call = (
                name.string in ("eval", "exec", "compile", "__import__") and after.string == "("
            )
            assert not (
                is_builtin_call and before.string != "."
            ), f"{path}:{name.start[0]}: {name.string}("
        if os.path.samefile(path, __file__):
            continue  # the patterns below are spelled out here
        code = re.sub(r"#.*", "", open(path).read())
        assert "pickle.load" not in code and "pickle.Unpickler(" not in code, path
        for subclass in re.findall(r"class \w+\(pickle\.Unpickler\)", code):  # admits a list
            assert "def find_class" in code and "UnpicklingError" in code, (path, subclass)
        for call in calls(code, "torch.load("):
            assert "weights_only=True" in call, (path, call)
        assert "trust_remote_code=True" not in code, path
    assert Config().model.trust_remote_code is False


# ---------------------------------------------------------------- numerics
@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_degenerate_batches_give_finite_zeros(mode):
    """In every loss mode: zero-variance, all-aborted and one-survivor groups get advantage 0,
    empty batches empty advantages, and a batch with nothing to train loss 0, zero statistics and
    finite gradients."""
    rewards, groups = torch.tensor([1.0, 1.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    # zero variance, all aborted, one left
    for alive in ([True] * 4, [False] * 4, [True, False, False, False]):
        advantages, _ = group_advantages(rewards, groups, torch.tensor(alive), scale_by_std=True)
        assert advantages.tolist() == [0.0] * 4
    empty, _ = group_advantages(
        torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool), True
    )
    assert empty.numel() == 0
    # a partial step with no group done
    cfg = load_config("configs/tiny.yaml", ["run.out=/tmp/unused"])
    trainer = types.SimpleNamespace(cfg=cfg)  # what the stage reads without a KL reference
    assert compute_advantages(trainer, []) == ([], {"train/degenerate_groups": summed(0)})
    logprobs = torch.zeros(2, 3, requires_grad=True)
    for mask in (torch.zeros(2, 3), torch.zeros(0, 3)):  # nothing trained; an empty batch
        lp = logprobs[: len(mask)]
        loss, stats = losses.policy_loss(
            lp,
            lp.detach(),
            torch.zeros(len(mask)),
            mask,
            agg_mode=mode,
            norm_length=4,
            engine_logprobs=lp.detach(),
            tis_cap=2.0,
            ref_logprobs=lp.detach(),
            terms={"kl": 0.1},
        )
        loss.backward()
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in stats.values())
        assert torch.isfinite(logprobs.grad).all()


def test_non_finite_updates_are_skipped_then_stop_the_run(engine, tmp_path, caplog, monkeypatch):
    """A NaN advantage makes the update non-finite: it is skipped (counted, logged) with
    parameters and AdamW moments untouched, training goes on after it, and max_bad_updates such
    steps in a row stop the run with a NonFiniteError, the step that stops it logged and dumped
    (train.py --replay) like the one before it; a run resumed from a checkpoint holding that
    streak stops before its first step (it trained on: the streak was asked only after a step)."""
    from test_train import rollout_batch, scalars

    cfg = tiny_config(
        tmp_path,
        "train.steps=5",
        "run.val_every=100",
        "train.max_bad_updates=2",
        "run.dump_rollouts=true",
    )
    run = train.setup(cfg, engine=engine)
    samples, advantages = rollout_batch(run)
    before = {name: p.detach().clone() for name, p in run.trainer.policy.named_parameters()}
    advantages[0] = math.nan  # one poisoned advantage: the loss and every gradient become NaN
    stats = train_on(run, samples, advantages)
    assert stats["train/skipped_updates"] == 1 and "update skipped" in caplog.text
    # untouched
    assert all(torch.equal(before[name], p) for name, p in run.trainer.policy.named_parameters())
    assert not any(
        torch.isnan(s).any()
        for group in run.trainer.optimizer.state.values()
        for s in group.values()
        if torch.is_tensor(s)
    )  # AdamW's moments stay clean
    advantages[0] = 0.0
    # and it trains on
    assert train_on(run, samples, advantages)["train/skipped_updates"] == 0

    # in the loop: max_bad_updates steps in a row stop the run with a named error (the policy itself
    # stays finite: a skipped update never reaches the engine)
    def poisoned(rewards, group_ids, is_valid, cfg):
        """NaN advantages, one per trajectory."""
        return torch.full_like(rewards, math.nan)

    monkeypatch.setitem(ESTIMATORS, "grpo", poisoned)
    # the direct update above changed the policy, not the engine: sync it, or the first step's
    # log-prob gap check (memory.py) rightly stops the run first
    engine.update_weights(run.trainer.policy.named_parameters(), version=0)
    with pytest.raises(update.NonFiniteError, match=r"2 steps in a row .*\(step 1\)"):
        train.train(run)
    assert all(torch.isfinite(p).all() for p in run.trainer.policy.parameters())
    assert scalars(tmp_path)["train/skipped_updates"] == [1, 1]  # steps 0 and 1
    assert sorted(os.listdir(tmp_path / "rollouts")) == ["step_000000", "step_000001"]
    # a checkpoint of that state (saved where step 1's weight sync failed after its update, before
    # the loop asked) stops a resumed run before its first step: it trained on, its streak reset
    checkpoint.save(str(tmp_path), 2, run)
    resumed = train.setup(cfg, resume=True, engine=engine)
    with pytest.raises(update.NonFiniteError, match=r"2 steps in a row .*\(step 1\)"):
        train.train(resumed)
    assert scalars(tmp_path)["train/skipped_updates"] == [1, 1]  # no step ran


def test_a_failed_rollout_or_sync_ends_the_run_with_a_checkpoint_written_once(
    engine, tmp_path, monkeypatch
):
    """Rewards failing past rollout.max_failed_ratio (RewardError) or the engine refusing a weight
    push (RolloutError) leave the trainer's state intact: the run saves it, as after an engine
    death, and the error names the checkpoint. A reviewer's harness found both exited 2 with no
    checkpoint (up to checkpoint_every steps lost; a failed sync also lost its step's record).
    Failed in step 2's rollout, step 2's prompts are put back (position 64); failed in its sync,
    the update is saved (step 3) and the step logged; failed in the validation right after,
    nothing is saved again; failed at a fresh run's first step, nothing is saved (the folder would
    refuse the same command). A save that fails too is said after the failure that caused it."""
    import memory
    from rewards import RewardError
    from runtime.engine import RolloutError

    saves = []
    real_save = checkpoint.save

    def counted_save(out_dir, step, run):
        saves.append(step)
        return real_save(out_dir, step, run)

    monkeypatch.setattr(checkpoint, "save", counted_save)
    recorded = []  # the steps logged (TensorBoard's reader orders two runs' files by name)
    real_record = train.record

    def counted_record(run, logger, step, *rest):
        recorded.append(step)
        return real_record(run, logger, step, *rest)

    monkeypatch.setattr(train, "record", counted_record)
    cfg = tiny_config(tmp_path, "train.steps=4", "run.val_every=100", "run.checkpoint_every=100")
    run = train.setup(cfg, engine=engine)
    honest = run.rewards.reward_fn

    def fails_from_step_2(text, answer, finished):
        if run.updates_done >= 2:
            raise ValueError("a broken reward")
        return honest(text, answer, finished)

    run.rewards.reward_fn = fails_from_step_2
    with pytest.raises(RewardError, match="saved in .*step_000002; --resume"):
        train.train(run)
    # a fresh run that failed before any update saves nothing: the same command starts again
    fresh = train.setup(tiny_config(tmp_path / "fresh", "run.val_every=100"), engine=engine)
    fresh.rewards.reward_fn = lambda text, answer, finished: 1 / 0
    with pytest.raises(RewardError, match="Nothing was trained yet: the same command starts"):
        train.train(fresh)
    assert checkpoint.latest(str(tmp_path / "fresh")) is None
    state = checkpoint.read_trainer_state(checkpoint.latest(str(tmp_path)))
    assert saves == [2] and state["prompt_positions"] == [2 * cfg.rollout.prompts_per_step]

    run = train.setup(cfg, resume=True, engine=engine)
    monkeypatch.setattr(
        memory, "sync_weights", lambda *a, **k: (_ for _ in ()).throw(RolloutError("refused"))
    )
    with pytest.raises(RolloutError, match="refused. .*saved in .*step_000003"):
        train.train(run)
    assert saves == [2, 3] and run.updates_done == 3
    assert recorded == [0, 1, 2]  # step 2 was logged

    run = train.setup(cfg, resume=True, engine=engine)
    validation = train.validation
    monkeypatch.setattr(
        train, "validation", lambda run: (_ for _ in ()).throw(RolloutError("stuck"))
    )
    with pytest.raises(RolloutError, match="stuck. .*saved in .*step_000003"):
        train.train(run)
    assert saves == [2, 3]
    # the save failing too (a full disk): the CheckpointError alone was raised, the cause lost
    monkeypatch.setattr(train, "validation", validation)
    full = checkpoint.CheckpointError("saving step_000004: OSError: No space left on device")
    monkeypatch.setattr(checkpoint, "save", lambda *a: (_ for _ in ()).throw(full))
    run = train.setup(cfg, resume=True, engine=engine)
    with pytest.raises(RolloutError) as failed:
        train.train(run)
    assert str(failed.value) == (
        f"refused. Saving the trainer's state after 4 updates failed too ({full}); the last "
        f"checkpoint: {checkpoint.latest(str(tmp_path))}"
    )


def test_a_signal_in_a_checkpoint_or_a_validation_stops_before_another_step(
    engine, tmp_path, monkeypatch
):
    """A SIGTERM that comes while a checkpoint is written, or during a validation, stops the run
    there, with the state saved once: it was read only after the next whole step (a cluster's
    grace period before SIGKILL is shorter than a GSM8K step). At a fresh run's first validation
    nothing is saved."""
    stop = types.SimpleNamespace(received=None)
    saves = []
    real_save = checkpoint.save

    def save_then_signal(out_dir, step, run):
        saves.append(step)
        path = real_save(out_dir, step, run)
        stop.received = "SIGTERM"
        return path

    monkeypatch.setattr(checkpoint, "save", save_then_signal)
    cfg = tiny_config(tmp_path, "train.steps=4", "run.val_every=100", "run.checkpoint_every=1")
    run = train.setup(cfg, engine=engine)
    assert train.train(run, stop) == "SIGTERM"
    assert run.updates_done == 1 and saves == [1]

    stop.received = None
    run = train.setup(cfg, resume=True, engine=engine)
    real_validation = train.validation

    def validation_then_signal(run):
        out = real_validation(run)
        stop.received = "SIGTERM"
        return out

    monkeypatch.setattr(train, "validation", validation_then_signal)
    assert train.train(run, stop) == "SIGTERM"
    assert run.updates_done == 1 and saves == [1]
    # at a fresh run's first validation: nothing trained, nothing saved (a checkpoint of the
    # weights it began with would make the folder refuse the same command)
    stop.received = None
    fresh = train.setup(tiny_config(tmp_path / "fresh", "run.val_every=100"), engine=engine)
    assert train.train(fresh, stop) == "SIGTERM"
    assert fresh.updates_done == 0 and saves == [1]


# ---------------------------------------------------------------- engine faults and load
PROMPTS = [[1, 5, 12], [1, 6, 4, 12], [1, 7, 12], [1, 5, 5, 12]]


@pytest.fixture
def engine_limits(engine):
    """Change the shared engine's rollout settings for one test, then put them back."""
    original = engine.cfg

    def set_limits(**changes):
        engine.cfg = dataclasses.replace(original, **changes)

    yield set_limits
    engine.cfg = original


def test_a_request_over_its_timeout_is_aborted_and_counted(
    engine, policy, engine_limits, caplog, monkeypatch
):
    """Requests over request_timeout_s are aborted inside the engine and logged: over
    max_failed_ratio a RolloutError, within it counted as failed samples; no request is left in
    the engine, and one whose abort the engine does not act on is a RolloutError. Greedy, the
    seeded policy never ends these prompts: every request runs its 200 tokens (~0.7 s on 2
    cores), far past each timeout. (Sampled, the last part's 8 answers took 0.17-0.47 s in all
    in five tries: they could all end within its timeout plus the abort's wait, 0.15 s, leaving
    nothing running and no error; it failed so twice.)"""
    engine_limits(request_timeout_s=0.05)
    with pytest.raises(train.RolloutError, match="requests failed inside the engine"):
        engine.generate(PROMPTS, 8, 0.0, 200)
    assert (
        engine.num_in_flight() == 0
        and "timed out after rollout.request_timeout_s=0.05" in caplog.text
    )
    # tolerated: failures are counted, not raised
    engine_limits(request_timeout_s=0.05, max_failed_ratio=1.0)
    samples, stats = engine.generate(PROMPTS, 8, 0.0, 200)
    assert stats.num_failed > 0 and all(s.masked for s in samples if s.finish_reason == "error")
    assert engine.num_in_flight() == 0
    # an abort the engine does not act on within rollout.abort_timeout_s: a RolloutError (the run
    # saves), as at the cancel decision; a reviewer found the rollout returning with the request
    # still in the engine, and the step then failing on the memory release with no checkpoint
    engine_limits(request_timeout_s=0.05, abort_timeout_s=0.1, max_failed_ratio=1.0)

    def dropped(*args, **kwargs):  # sent, and never acted on
        return None

    match = "abort did not return within 0.1s"
    with_aborts(engine, monkeypatch, dropped, match, PROMPTS, 2, temperature=0.0)


def test_the_ways_to_fit_a_request_name_the_field_that_sets_the_budget():
    """A reviewer found the request-limit advice "lower max_new_tokens by N" doing nothing where
    max_response_tokens sets the budget (configs/gsm8k_tool.yaml's 5 turns), going below 1, and a
    prompt bound emptying the val split. Each way, followed, gives back the tokens over."""
    from assemble import ways_to_fit
    from config import RolloutConfig

    def fits(r, over):
        return [way for way in ways_to_fit(r, [[4, 30]], 30, over) if "rollout." in way]

    tool = RolloutConfig(max_new_tokens=512, max_turns=5, max_response_tokens=2048)
    assert fits(tool, 206) == ["set rollout.max_response_tokens to 1842"]
    turns = RolloutConfig(max_new_tokens=100, max_turns=3)  # 300: each token of a turn gives 3
    assert fits(turns, 7) == ["set rollout.max_new_tokens to 97"]
    one = RolloutConfig(max_new_tokens=1500, max_response_tokens=1000)
    assert fits(one, 98) == ["set rollout.max_response_tokens to 902"]
    assert fits(RolloutConfig(max_new_tokens=8), 9) == []  # no budget left to give
    # a prompt bound that keeps a prompt of each split, or none offered
    r = RolloutConfig(max_new_tokens=8)
    assert ways_to_fit(r, [[4, 30], [20]], 30, 9)[-1] == (
        "set data.max_prompt_len to 21 (keeps 1 of 2 train and 1 of 1 val prompts)"
    )
    assert ways_to_fit(r, [[4, 30], [25]], 30, 9) == [
        "a model with a longer context (the prompts alone leave no room)"
    ]
    # a later reader: a first prompt over its own limit takes no budget cut (the advice, followed,
    # was refused again), and where rollout.max_total_tokens (the KV pool), not the context, is
    # the limit, raising it is offered
    assert fits(RolloutConfig(max_new_tokens=48), 9) == ["set rollout.max_new_tokens to 39"]
    assert ways_to_fit(RolloutConfig(max_new_tokens=48), [[4, 30]], 30, 9, prompt_over=2) == [
        "set data.max_prompt_len to 21 (keeps 1 of 2 train prompts)"
    ]
    pool = RolloutConfig(max_new_tokens=48, max_total_tokens=256)
    assert ways_to_fit(pool, [[300]], 300, 94, pool_room=1000) == [
        "set rollout.max_total_tokens to 350"
    ]


def test_a_rollout_over_its_timeout_aborts_the_rest(engine, engine_limits):
    """At rollout_timeout_s the rollout aborts what still runs (counted as timed out and
    cancelled, masked like any cancelled sample) and returns within the timeout plus the abort's.
    A training rollout's (a plan, here cancel: none): validation waits for every request."""
    from cancel import plan_launch

    def training(num_prompts, group_size):
        rollout = tiny_config("/tmp", f"rollout.group_size={group_size}").rollout
        return plan_launch(rollout, num_prompts)

    engine_limits(rollout_timeout_s=0.3)
    # 256 requests of up to 200 tokens
    samples, stats = engine.generate(PROMPTS * 8, 8, 1.0, 200, plan=training(len(PROMPTS) * 8, 8))
    assert (
        stats.num_timed_out > 0
        and stats.num_cancelled > 0
        and stats.rollout_s < 0.3 + engine.cfg.abort_timeout_s
    )
    # masked like any cancelled sample
    assert sum(s.masked for s in samples) == stats.num_cancelled
    assert engine.num_in_flight() == 0
    # a trajectory whose reward still runs at the timeout has nothing left to abort: it trains,
    # and is not counted as timed out (a reviewer found every unfinished trajectory counted: 16
    # timed out, 4 cut)
    engine_limits(rollout_timeout_s=0.5)

    async def slow_reward(turns):
        await asyncio.sleep(1.5)
        return 0.5

    plan = training(len(PROMPTS), 4)
    samples, stats = engine.generate(PROMPTS, 4, 1.0, 4, reward=slow_reward, plan=plan)
    assert stats.rollout_s > 1.5 and all(s.reward == 0.5 for s in samples if not s.masked)
    assert stats.num_timed_out == stats.num_cancelled < len(samples)


def test_an_abort_that_fails_in_the_engine_leaves_no_task_running(engine, monkeypatch):
    """An abort the engine refuses (its send to the scheduler raised) at the count policy's
    decision is a RolloutError (the run then saves its checkpoint), and the rollout's tasks end
    with it: a reviewer found a plain RuntimeError, and the trajectories and rewards still pending
    on the engine's loop, to run at its next use."""
    from cancel import plan_launch

    plan = plan_launch(
        tiny_config("/tmp", "rollout.cancel=count", "rollout.drop_rate=0.5").rollout, 4
    )

    def refused(*args, **kwargs):
        raise RuntimeError("zmq send failed")

    match = "aborting .* requests failed in the engine"
    with_aborts(engine, monkeypatch, refused, match, PROMPTS, 8, plan)


def with_aborts(
    engine, monkeypatch, abort_request, match, prompts, group_size, plan=None, temperature=1.0
):
    """A rollout on the shared engine whose SGLang abort_request is replaced: a RolloutError
    matching `match`, and no rollout task left on the engine's loop. Then the requests it kept
    from being aborted are let go, on that loop."""
    manager = engine.tokenizer_manager
    real = manager.abort_request
    monkeypatch.setattr(manager, "abort_request", abort_request)
    try:
        with pytest.raises(train.RolloutError, match=match):
            engine.generate(prompts, group_size, temperature, 200, plan)
        left = [
            task
            for task in asyncio.all_tasks(engine.engine.loop)
            if task.get_coro().__name__ == "with_reward"
        ]
        assert not left, left
    finally:
        monkeypatch.setattr(manager, "abort_request", real)

        async def let_go(deadline=time.perf_counter() + 30):
            manager.abort_request(abort_all=True)
            while manager.rid_to_state and time.perf_counter() < deadline:
                await asyncio.sleep(0.05)

        engine._run(let_go())
    assert engine.num_in_flight() == 0


def test_4096_concurrent_requests_complete_or_cancel(engine, tmp_path):
    """4,096 requests launched at once with count cancellation all come back, finished or
    cancelled, at least the target finished and none left in the engine (the time and the
    trainer's peak memory are printed)."""
    import resource
    from cancel import plan_launch

    prompts = [[1, 5 + i % 10, 12] for i in range(512)]
    plan = plan_launch(
        tiny_config(tmp_path, "rollout.cancel=count", "rollout.drop_rate=0.5").rollout, 512
    )
    start = time.perf_counter()
    samples, stats = engine.generate(prompts, 8, 1.0, 4, plan)  # 4,096 requests at once
    seconds = time.perf_counter() - start
    assert len(samples) == 4096 and engine.num_in_flight() == 0
    assert sum(not s.masked for s in samples) >= plan.target_samples
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"load: 4096 requests in {seconds:.1f} s, {stats.num_cancelled} cancelled, "
        f"trainer peak RSS {peak_mib:.0f} MiB"
    )


# ---------------------------------------------------------------- the process: engine death,
# signals
def start_training(out_dir, new_session=False):
    """`python train.py` on the CPU demo as a user starts it; stdout is read line by line."""
    command = [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny.yaml",
        "--out",
        str(out_dir),
        "--set",
        "run.val_every=1000",
        "--set",
        "data.num_val_prompts=16",  # validated at step 0: 16 prompts, not the demo's 256
        "--set",
        "run.checkpoint_every=0",
        "--set",
        "train.steps=400",
    ]
    stderr = open(out_dir / "stderr.txt", "w+")
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=new_session,
    )
    return process, stderr


def wait_for_step(process, step, timeout=240):
    """Read the console until the line of `step` (the trainer is then in step + 1)."""
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        if line.startswith(f"step {step:4d} |"):
            return
        assert time.monotonic() < deadline, f"the run did not reach step {step}"
    raise AssertionError(f"train.py exited before step {step}: rc {process.wait()}")


def finish(process, stderr, timeout):
    """(exit code, stderr text, seconds it took to exit)."""
    start = time.monotonic()
    try:
        rc = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"train.py did not exit within {timeout}s")
    stderr.seek(0)
    return rc, stderr.read(), time.monotonic() - start


def engine_processes(process):
    return [p for p in psutil.Process(process.pid).children(recursive=True)]


DEAD_ENGINE_OUT = os.path.join(scratch("dead_engine"), "run")
KILL_THE_SCHEDULER = """
import json, os, subprocess, sys, time
import psutil
out = {out!r}
os.makedirs(out, exist_ok=True)
command = [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--out", out,
           "--set", "run.val_every=1000", "--set", "run.checkpoint_every=0",
           "--set", "train.steps=400", "--set", "data.num_val_prompts=16"]
stderr = open(os.path.join(out, "stderr.txt"), "w")
process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
for line in process.stdout:  # the trainer is in step 3 once step 2's line is out
    if line.startswith("step    2 |"):
        break
children = psutil.Process(process.pid).children(recursive=True)
schedulers = [p for p in children if "scheduler" in " ".join(p.cmdline()) + p.name()]
schedulers[0].kill()  # SIGKILL: no chance to say goodbye
start = time.monotonic()
try:
    rc = process.wait(timeout=60)
except subprocess.TimeoutExpired:
    process.kill()
    rc = "timeout"
print(json.dumps({{"rc": rc, "seconds": time.monotonic() - start, "schedulers": len(schedulers)}}))
"""


@pytest.mark.background(
    "dead_engine", [sys.executable, "-c", KILL_THE_SCHEDULER.format(out=DEAD_ENGINE_OUT)]
)
def test_a_dead_engine_scheduler_ends_the_run_with_a_message_and_a_checkpoint(background_runs):
    """`python train.py` whose scheduler is SIGKILLed in step 3 (its own engine: it dies; run in
    the background by a small script that drives it, as a user's terminal would) exits 2 within
    60 s with an EngineDiedError naming the scheduler, no traceback, and a loadable checkpoint of
    step 3 or later, at the data position of the steps it trained."""
    done = background_runs.result("dead_engine")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    err = open(os.path.join(DEAD_ENGINE_OUT, "stderr.txt")).read()
    assert result["schedulers"] >= 1 and result["rc"] == 2 and result["seconds"] < 60, (
        result,
        err[-2000:],
    )
    assert "EngineDiedError: the SGLang engine died: scheduler_0" in err and "Traceback" not in err
    saved = checkpoint.latest(DEAD_ENGINE_OUT)
    state = checkpoint.read_trainer_state(saved)  # loadable: the trainer state and the model folder
    assert state["step"] >= 3 and f"saved in {saved}" in err
    # dead before its update, the step put back the 32 prompts it took: --resume runs it again
    assert state["prompt_positions"] == [32 * state["step"]], state["prompt_positions"]
    AutoModelForCausalLM.from_pretrained(saved)


def test_sigterm_in_training_finishes_the_step_saves_shuts_the_engine_down_and_exits(tmp_path):
    """A SIGTERM to the trainer while it trains (a scheduler's preemption: Kubernetes, Slurm)
    finishes the step, saves, shuts the engine down and exits 128 + SIGTERM, no traceback. The
    trainer's handler is installed before the engine starts (a signal in the start-up is heard),
    and SGLang's request loop took SIGTERM over when it was made: uvloop recorded the signal and
    answered it only when some later signal came during a run, so the run trained on until a
    SIGKILL. (A Ctrl-C takes the same path through StopSignal: the engine's processes ignoring it
    is the start-up test below; resuming is test_train's test_resume_gives_the_same_next_step; the
    second signal: test_a_second_signal_exits_at_once_with_130. Each `train.py` start costs the
    suite ~60 s.)"""
    process, stderr = start_training(tmp_path, new_session=True)
    wait_for_step(process, 1)
    children = engine_processes(process)
    os.kill(process.pid, signal.SIGTERM)  # the trainer's process alone, as a scheduler sends it
    rc, err, seconds = finish(process, stderr, timeout=60)
    assert (
        rc == 128 + signal.SIGTERM
        and "stopped by SIGTERM after a checkpoint; --resume continues" in err
    ), (rc, err[-2000:])
    assert "Traceback" not in err
    saved = checkpoint.read_trainer_state(checkpoint.latest(str(tmp_path)))["step"]
    assert saved >= 2
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


CTRL_C_AT_START_OUT = os.path.join(scratch("ctrl_c_at_start"), "run")
CTRL_C_AT_START = """
import json, os, signal, subprocess, sys, time
import psutil
out = {out!r}
os.makedirs(out, exist_ok=True)
command = [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--out", out,
           "--set", "data.num_val_prompts=8", "--set", "train.steps=3"]
stderr = open(os.path.join(out, "stderr.txt"), "w")
process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                           start_new_session=True)
def engine_processes():  # the scheduler and the detokenizer once forked (not the resource tracker)
    found = []
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found
while len(engine_processes()) < 2 and process.poll() is None:
    time.sleep(0.05)
time.sleep(1)  # they import SGLang for ~10 s more before the engine is up
forked = engine_processes()
os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole process group
try:
    rc = process.wait(timeout=120)
except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    rc = "timeout"
alive = [p.pid for p in forked if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
print(json.dumps({{"rc": rc, "forked": len(forked), "alive": alive,
                  "stdout": process.stdout.read()}}))
"""


@pytest.mark.background(
    "ctrl_c_at_start", [sys.executable, "-c", CTRL_C_AT_START.format(out=CTRL_C_AT_START_OUT)]
)
def test_ctrl_c_during_the_engine_start_up_stops_the_run_once_it_is_up(background_runs):
    """`python train.py` with Ctrl-C while its engine starts (its processes forked, importing
    SGLang; its own engine: the start-up is the subject; run in the background by a small script
    that drives it): the trainer hears it (it was ignored, and the run went on to train), the
    engine comes up (its processes ignored the Ctrl-C: one that died would fail the start with a
    RuntimeError), and the run stops before any step, the engine shut down, exit 130."""
    done = background_runs.result("ctrl_c_at_start")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    err = open(os.path.join(CTRL_C_AT_START_OUT, "stderr.txt")).read()
    assert result["forked"] >= 2 and result["rc"] == 130, (result, err[-2000:])
    assert "SIGINT: finishing this set-up, step or validation" in err
    assert "stopped by SIGINT before any update: nothing saved" in err and "Traceback" not in err
    assert "step" not in result["stdout"] and not result["alive"], result


def test_ctrl_c_during_setup_names_sigint_and_exits_130(monkeypatch, capsys):
    """A Ctrl-C before run_rank's StopSignal is in (here while the config loads) is Python's own
    KeyboardInterrupt, whose text is empty: the message names SIGINT, and train.py exits 130.
    (train.py's command-line block run in this process: its modules are already imported.)"""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("assemble.load_config", interrupted)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(
            os.path.join(os.path.dirname(train.__file__), "train.py"), run_name="__main__"
        )
    assert exited.value.code == 130
    assert "interrupted (SIGINT): exited at once" in capsys.readouterr().err


def test_a_second_signal_exits_at_once_with_130():
    """The first SIGTERM is only noted (the step goes on); a repeat within REPEAT_S is the same
    signal (a launcher forwarding the terminal's Ctrl-C) and changes nothing; a second one later
    kills the engine's processes and exits 130 at once. Run in a forked copy of this process:
    `kill_engine_processes` ends the children of the process it runs in, and the fork has none
    (the shared engine's processes, if started, are the parent's)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its stderr into the pipe (pytest replaced sys.stderr; the exit's
        # line is written to fd 2 itself, without blocking), two signals
        os.dup2(write, 2)
        sys.stderr = os.fdopen(write, "w")
        stop = StopSignal()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same one, forwarded: still going
        print(f"first: {stop.received}", file=sys.stderr, flush=True)
        time.sleep(StopSignal.REPEAT_S)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler exits the process
        os._exit(3)  # not reached
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        err = f.read()
    assert os.waitstatus_to_exitcode(status) == 130, err
    assert "first: SIGTERM" in err and "interrupted (second signal (SIGTERM))" in err, err


def test_a_trajectory_longer_than_an_engine_request_is_refused_before_the_engine_starts(
    engine, tmp_path, monkeypatch
):
    """SGLang cuts a request's max_new_tokens to what its context length and KV pool leave,
    logged only in its own log (a KV pool of 40 tokens generated at most 34 of the demo's 48), or
    refuses it: the trainer's budget, mask_truncated and overlong penalty then assume tokens that
    were never allowed. setup refuses such a run, naming the numbers, before an engine starts;
    `request_limits` agrees with the shared engine's own limit on a prompt."""
    import assemble
    from runtime.engine import request_limits

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(assemble, "start_engine", no_engine)
    sets = {
        "rollout.max_total_tokens=40": "needs up to 52 tokens .* holds 38",
        "rollout.max_new_tokens=400": "needs up to 404 tokens .* holds 254",
    }
    for item, message in sets.items():
        with pytest.raises(ConfigError, match=message):
            assemble.setup(tiny_config(tmp_path, item))
    # the advice, followed as given, fits (a reviewer found it naming data.max_prompt_len where
    # the prompts are 4 tokens, and no number)
    with pytest.raises(
        ConfigError, match="150 tokens too many; set rollout.max_new_tokens to 250$"
    ):
        assemble.setup(tiny_config(tmp_path, "rollout.max_new_tokens=400"))
    with pytest.raises(AssertionError, match="the engine was started"):
        assemble.setup(tiny_config(tmp_path, "rollout.max_new_tokens=250"))
    # partial rollout resumes a cancelled response as the next request's prompt (up to the
    # prompt and 247 tokens here, past the 249 a prompt may hold), though the whole fits
    partial = [
        "rollout.cancel=count",
        "rollout.drop_rate=0.25",
        "rollout.partial=true",
        "train.tis_cap=2",
    ]
    with pytest.raises(
        ConfigError, match="up to 252 tokens .* of up to 251.*max_new_tokens to 246$"
    ):
        assemble.setup(tiny_config(tmp_path, "rollout.max_new_tokens=248", *partial))
    with pytest.raises(AssertionError, match="the engine was started"):
        assemble.setup(tiny_config(tmp_path, "rollout.max_new_tokens=246", *partial))
    with pytest.raises(AssertionError, match="the engine was started"):  # fits without partial
        assemble.setup(tiny_config(tmp_path, "rollout.max_new_tokens=248"))
    cfg = tiny_config(tmp_path)
    policy, _ = model.build_policy(cfg, None)
    info = engine.engine._scheduler_init_result.scheduler_infos[0]
    # (the pool holds more than the context: the context decides)
    assert info["max_total_num_tokens"] > cfg.model.max_position_embeddings
    # a prompt is refused from max_req_input_len tokens on (managers/scheduler.py)
    assert request_limits(policy.config, 0)[1] == info["max_req_input_len"] - 1


def test_the_second_signals_line_never_holds_the_exit(tmp_path):
    """The second signal's line goes to stderr where it can; where the write would wait (a full
    pipe: a pager not reading, another rank's writer filling it; a full socket) the call returns
    after its short wait all the same, since the exit comes next. fd 2's own open file stays
    blocking (it is shared with the shell and the other ranks). In a fresh process (a write that
    blocks hangs it, not the suite): each case is fd 2 replaced; where the line can go, it is
    read back."""
    script = """if True:
        import os, socket, sys, time
        import runtime.engine as engine

        def full(fd):
            os.set_blocking(fd, False)
            try:
                while True:
                    os.write(fd, b"x" * 4096)
            except BlockingIOError:
                os.set_blocking(fd, True)

        def read_back(fd):  # what came, the line's writer given up to 5 s on a busy machine
            os.set_blocking(fd, False)
            got, deadline = b"", time.monotonic() + 5
            while b"interrupted" not in got and time.monotonic() < deadline:
                try:
                    got += os.read(fd, 1 << 16)
                except BlockingIOError:
                    time.sleep(0.01)
            return got.count(b"interrupted")

        for case in sys.argv[2:]:
            if case in ("socket", "full socket"):
                ours, theirs = socket.socketpair()
                read, write = os.dup(theirs.fileno()), os.dup(ours.fileno())
            elif case == "file":
                read, write = None, os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)
            else:
                read, write = os.pipe()
            if case.startswith("full"):
                full(write)
            if case == "no reader":
                os.close(read)
            os.dup2(write, 2)
            start = time.monotonic()
            engine.write_without_blocking("interrupted\\n")
            returned = time.monotonic() - start < 2
            blocking = os.get_blocking(2)
            if case == "file":
                count = open(sys.argv[1]).read().count("interrupted")
            elif case in ("room", "socket"):
                count = read_back(read)
            else:
                count = "-"
            print(case.replace(" ", "_"), returned, blocking, count, flush=True)
    """
    cases = ["room", "full pipe", "no reader", "file", "socket", "full socket"]
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "err"), *cases],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,  # a write that blocks would hang here
    )
    written = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    assert written == {
        "room": ["True", "True", "1"],
        "full_pipe": ["True", "True", "-"],
        "no_reader": ["True", "True", "-"],
        "file": ["True", "True", "1"],
        "socket": ["True", "True", "1"],
        "full_socket": ["True", "True", "-"],
    }, done.stderr


def test_the_second_signals_kill_spares_the_resource_tracker():
    """`kill_engine_processes` (a second Ctrl-C) kills every process below the trainer but
    multiprocessing's resource tracker: once the trainer has exited, the tracker unlinks the shared
    memory and semaphores the engine's processes registered; killed with the rest (as SGLang's
    kill does) they stayed in /dev/shm. In a fresh process with one child and one shared-memory
    block registered, no engine."""
    script = """if True:
        import os, subprocess, sys
        from multiprocessing import resource_tracker, shared_memory
        import runtime.engine as engine
        block = shared_memory.SharedMemory(create=True, size=4096)  # starts the tracker
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        engine.kill_engine_processes()
        print(block.name, child.wait(10), resource_tracker._resource_tracker._pid, flush=True)
        os._exit(130)  # as the second signal exits
    """
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    name, child_status, tracker = done.stdout.split()
    assert tracker != "None"  # it was running
    assert done.returncode == 130 and child_status == str(-signal.SIGKILL), done.stderr
    deadline = time.monotonic() + 20
    while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/dev/shm/{name}"), "the tracker was killed: the block stayed"


def test_one_sigterm_is_one_signal_whenever_the_engine_loop_runs_next(engine, monkeypatch):
    """A SIGTERM while training is handled once: the engine's event loop, run after it, does not
    answer it a second time (a second answer later than REPEAT_S would be a second signal: exit
    130, no checkpoint). Here every repeat counts as a second signal, and the exit and the kill
    are recorded, not done."""
    exits = []
    monkeypatch.setattr(StopSignal, "REPEAT_S", 0.0)
    monkeypatch.setattr("runtime.engine.kill_engine_processes", lambda: exits.append("kill"))
    monkeypatch.setattr(os, "_exit", exits.append)
    stop = StopSignal()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        engine._run(asyncio.sleep(0.05))  # what the step runs next
    finally:
        stop.restore()
    assert stop.received == "SIGTERM" and exits == []


def test_a_sigterm_in_a_rollout_is_the_trainers_not_sglangs(engine, monkeypatch):
    """A SIGTERM that comes while the engine's event loop runs (a rollout) reaches StopSignal
    alone: SGLang's own handler, left on the loop, set its graceful exit, which drained the engine
    and exited the process 0 with no checkpoint (tokenizer_manager.py, sigterm_watchdog). A
    SIGQUIT (an engine process raised) while training is recorded at once: the loop's handler
    kept it until some later signal."""
    exits = []
    monkeypatch.setattr("runtime.engine.kill_engine_processes", lambda: exits.append("kill"))
    monkeypatch.setattr(os, "_exit", exits.append)
    stop = StopSignal()
    try:

        async def rollout():
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.1)

        engine._run(rollout())
    finally:
        stop.restore()
    assert stop.received == "SIGTERM" and exits == []
    assert not engine.tokenizer_manager.gracefully_exit
    os.kill(os.getpid(), signal.SIGQUIT)
    try:
        assert (
            engine.child_failed
            == "it raised an exception and sent SIGQUIT (its traceback is above)"
        )
    finally:
        engine.child_failed = None  # the shared engine's processes are alive


def test_an_engine_process_not_reaped_at_shutdown_is_a_warning(engine, monkeypatch, caplog):
    """SGLang's shutdown raises RuntimeError when a process it SIGKILLed is not reaped within
    60 s (srt/utils/common.py): likeliest right after the engine died, where train.py's `finally`
    shut it down and that error replaced the EngineDiedError saying where the checkpoint is."""

    def cannot_reap():
        raise RuntimeError("kill_process_tree: 1 process(es) not reaped within 60s; pids=[4242]")

    monkeypatch.setattr(engine.engine, "shutdown", cannot_reap)
    with caplog.at_level(logging.WARNING, logger="engine"):
        engine.shutdown()
    assert "the engine's shutdown: kill_process_tree: 1 process(es) not reaped" in caplog.text


KEEP_SAVING = """
import sys, torch
sys.path.insert(0, {repo!r})
import runtime.checkpoint as checkpoint, runtime.model as model, assemble as setup_run
import task.data as tasks
cfg = setup_run.load_config("configs/tiny.yaml", ["run.out={out}"])
policy, tokenizer = model.build_policy(cfg, None)
# the trainer half, and what a checkpoint's HF export and data position need
run = setup_run.Run(
    cfg, trainer=setup_run.trainer_only(cfg, policy), tokenizer=tokenizer,
    stream=tasks.PromptStream([], 0),
)
for step in range(1, 10_000):
    with torch.no_grad():
        next(policy.parameters()).fill_(step)  # each checkpoint's weights say which step wrote them
    checkpoint.save("{out}", step, run)
    print(step, flush=True)
"""


def test_sigkill_while_writing_checkpoints_leaves_the_last_complete_one_loadable(tmp_path):
    """A process saving checkpoints back to back is SIGKILLed at a random moment, several times: the
    newest complete checkpoint always loads, with the weights of the step it names."""
    rng = random.Random(0)
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        process = subprocess.Popen(
            [sys.executable, "-c", KEEP_SAVING.format(repo=REPO, out=out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(rng.randint(2, 4)):  # let a few checkpoints complete
            assert process.stdout.readline(), "the saving process died on its own"
        time.sleep(rng.uniform(0, 0.3))  # then kill it somewhere inside the next save
        process.kill()
        process.wait()
        saved = checkpoint.latest(str(out))
        step = checkpoint.read_trainer_state(saved)["step"]
        model = AutoModelForCausalLM.from_pretrained(saved)
        # complete: the weights of that very step
        assert torch.all(next(model.parameters()) == step)


def runs_our_code(task):
    """Whether an asyncio task runs a coroutine defined in one of the trainer's own modules (the
    rollout's tasks run `inflight.with_reward`, and `asyncio.wait_for` wraps `Engine.request` in
    one)."""
    code = getattr(task.get_coro(), "cr_code", None)
    if code is None:  # not a Python coroutine
        return False
    # anywhere in the repository: Engine.request is runtime/engine.py's
    return os.path.realpath(code.co_filename).startswith(os.path.realpath(REPO) + os.sep)


def test_no_rollout_task_outlives_its_rollout(engine, tmp_path):
    """After a rollout that waits for every sample and after one that cancels its tail, no task
    running the trainer's code is left pending on the engine's event loop, and the engine tracks
    no request. (The one check of its kind: the other engine tests assert num_in_flight() == 0.)"""
    from cancel import plan_launch

    plan = plan_launch(
        tiny_config(tmp_path, "rollout.cancel=count", "rollout.drop_rate=0.5").rollout, 4
    )
    for rollout_plan in (None, plan):
        _, stats = engine.generate(PROMPTS, 8, 1.0, 64, rollout_plan)
        # all_tasks: the tasks not done yet
        pending = [t for t in asyncio.all_tasks(engine.engine.loop) if runs_our_code(t)]
        assert pending == [] and engine.num_in_flight() == 0
    assert stats.num_cancelled > 0  # the second rollout did abort requests inside the engine
