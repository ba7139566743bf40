"""Judging and replaying a run: extras/eval.py's metrics against hand-computed examples, and on a
short demo run with the shared engine: training's val/pass@k, the eval line, and a dumped step's
update replayed exactly with no engine."""

import errno
import json
import os
import re

import pytest
import torch

import extras.eval as evaluation
import extras.replay as replay
import runtime.model as model
import task.gsm8k as gsm8k
import train
from config import ConfigError
from conftest import tiny_config
from metrics import pass_at_k
from test_train import scalars


def test_pass_at_k_is_the_unbiased_estimator():
    """1 - C(n-c, k) / C(n, k), by hand: n=5, c=2: pass@1 = 2/5, pass@2 = 1 - 3/10; no correct
    sample gives 0, and k > n - c gives 1."""
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(200, 10, 5) == pytest.approx(
        1 - (190 * 189 * 188 * 187 * 186) / (200 * 199 * 198 * 197 * 196)
    )
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


def test_majority_vote_and_bootstrap_interval():
    """maj@k: the most frequent answer decides (no answer never wins), and it is correct when any
    sample that gave it scored 1, whatever their order (the first one's score decided); GSM8K's -0
    votes with 0. The interval holds the mean and narrows with more prompts."""
    assert evaluation.majority_correct(["7", "8", "7", None], [True, False, True, False]) == 1.0
    assert evaluation.majority_correct(["8", "7", "8"], [False, True, False]) == 0.0
    assert evaluation.majority_correct([None, None], [False, False]) == 0.0
    # one answer scored apart (a format, an unfinished sample): the answer is right in any order
    for correct in ([True, False, False], [False, True, False], [False, False, True]):
        assert evaluation.majority_correct(["7", "7", "7"], correct) == 1.0
    assert gsm8k.answer_of("#### -0") == gsm8k.answer_of("#### 0.0") == "0"  # one vote
    few = evaluation.bootstrap_interval([0.0, 1.0] * 5)
    many = evaluation.bootstrap_interval([0.0, 1.0] * 200)
    assert few[0] < 0.5 < few[1] and many[0] < 0.5 < many[1]
    assert many[1] - many[0] < few[1] - few[0]


def test_pass_at_k_and_eval_summaries_count_what_scored_1():
    """Validation's pass@k (rollout.pass_at_ks) and eval's summary (summarise) on hand-scored
    samples: the tiny task's validation rarely scores 1, so the run below logs pass@k near 0
    whatever they count. Two prompts of 4 samples: the first with 3 correct (a 0.999 reward is
    not), the second none; eval's greedy record counts in greedy alone, not in pass@k's n."""
    import rollout
    from sample import Sample

    rewards = [[1.0, 1.0, 0.999, 1.0], [0.5, 0.0, 0.0, 0.0]]
    samples = [Sample([1], [2], [0.0], [1], group_id=g) for g in (0, 1) for _ in range(4)]
    for sample, reward in zip(samples, rewards[0] + rewards[1]):
        sample.reward = reward
    # the first prompt: pass@1 = 3/4, pass@2 = 1 - C(1,2)/C(4,2) = 1, pass@4 = 1; the second: 0
    expected = {"val/pass@1": 0.375, "val/pass@2": 0.5, "val/pass@4": 0.5}
    assert rollout.pass_at_ks([[s] for s in samples], 4) == expected
    answers = [["4", "4", "3", "4"], ["1", "1", "1", "2"]]
    per_prompt = [
        [
            {"sample": i, "reward": reward, "answer_extracted": answer}
            for i, (reward, answer) in enumerate(zip(rewards[p], answers[p]))
        ]
        + [{"sample": "greedy", "reward": float(p == 0), "answer_extracted": answers[p][0]}]
        for p in (0, 1)
    ]
    summary = evaluation.summarise(per_prompt, [1, 2, 4], with_majority=True)
    means = {name: mean for name, (mean, _) in summary.items()}
    assert means == {
        "pass@1": 0.375,
        "pass@2": 0.5,
        "pass@4": 0.5,
        "maj@1": 0.5,
        "maj@2": 0.5,
        "maj@4": 0.5,
        "greedy": 0.5,
        "mean_reward": pytest.approx((sum(rewards[0]) + sum(rewards[1])) / 8),
    }


def test_a_run_logs_pass_at_k_evaluates_and_replays_a_step_exactly(engine, tmp_path, capsys):
    """A 3-step demo run with run.val_samples=4 logs val/pass@1..4 (non-decreasing in k); its
    last checkpoint, loaded into the engine as `extras/eval.py --run` loads it, evaluates to the
    eval line (pass@k non-decreasing, pass@1 inside its interval) with every sample recorded; and
    the update of dumped step 2, replayed with no engine and with the config the dump holds (the
    run's config.yaml since changed), reproduces its logged loss and gradient norm exactly, on
    the step's own thread count (torch's default, a thread a core, moved the last bits)."""
    cfg = tiny_config(
        tmp_path,
        "train.steps=3",
        "run.val_every=2",
        "run.val_samples=4",
        "run.dump_rollouts=true",
        "run.checkpoint_every=1",
        "data.num_val_prompts=8",
    )
    train.train(train.setup(cfg, engine=engine))
    logged = scalars(tmp_path)
    passes = [logged[f"val/pass@{k}"][-1] for k in (1, 2, 4)]
    assert passes == sorted(passes) and len(logged["val/pass@1"]) == 3  # steps 0, 2, final

    # a later `--resume --set` rewrites the run's config.yaml: the dump holds its own
    config_yaml = tmp_path / "config.yaml"
    written = config_yaml.read_text()
    config_yaml.write_text(written.replace("loss_agg: token-mean", "loss_agg: seq-mean-token-sum"))
    replayed = replay.replay(str(tmp_path / "rollouts" / "step_000002"))
    config_yaml.write_text(written)
    assert (
        (replayed.loss, replayed.grad_norm)
        == (replayed.logged_loss, replayed.logged_grad_norm)
        == (logged["train/loss"][2], logged["train/grad_norm"][2])
    )
    # and the weights the step ends at are checkpoint 3's, bit for bit
    assert replayed.exact and replayed.weights_differ == 0
    assert replayed.after == str(tmp_path / "checkpoints" / "step_000003")
    capsys.readouterr()
    # on a bigger machine (torch's default: a thread a core): the step's own thread count
    torch.set_num_threads(4)
    try:
        train.main(["--replay", str(tmp_path / "rollouts" / "step_000002")])  # what a user runs
    finally:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    assert threads == cfg.train.threads == 1
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("step_000003's exact=True") and f"loss={replayed.loss!r} " in line, line
    # another learning rate in the dump: loss and gradient norm come before the optimizer step,
    # so they still agree; the weights after it do not
    dumped = tmp_path / "rollouts" / "step_000002" / "rank_0.pt"
    state = torch.load(dumped, weights_only=True)
    state["config"]["train"]["lr"] *= 100
    torch.save(state, dumped)
    other = replay.replay(str(dumped.parent))
    assert (other.loss, other.grad_norm) == (replayed.loss, replayed.grad_norm)
    assert other.weights_differ > 0 and not other.exact

    # a run's config that a later load_config refuses (a setting it does not read: the clip
    # range with one minibatch) still evaluates: eval reads its types and bounds again only
    config_yaml.write_text(written.replace("clip_eps_high: 0.0\n", "clip_eps_high: 0.28\n"))
    args = evaluation.parse_args(["--run", str(tmp_path), "--samples", "4", "--k", "1,2,4"])
    eval_cfg, folder, step, lora_served = evaluation.model_folder(args)
    assert eval_cfg.train.clip_eps_high == 0.28
    assert folder.endswith("step_000003") and step == 3 and lora_served is None
    policy, tokenizer = model.build_policy(eval_cfg, folder)
    engine.update_weights(policy.named_parameters(), version=step)  # what start_engine loads
    per_prompt, summary = evaluation.run_eval(eval_cfg, engine, tokenizer, 4, args.k, 1.0)
    line = evaluation.eval_line(summary, len(per_prompt))
    match = re.fullmatch(
        r"eval: n=8 pass@1=([\d.]+) \[([\d.]+),([\d.]+)\] pass@2=([\d.]+) \[[\d.,]+\] "
        r"pass@4=([\d.]+) \[[\d.,]+\] maj@1=[\d.]+ \[[\d.,]+\] maj@2=[\d.]+ \[[\d.,]+\] "
        r"maj@4=[\d.]+ \[[\d.,]+\] greedy=[\d.]+ \[[\d.,]+\] mean_reward=[\d.]+",
        line,
    )
    assert match, line
    p1, low, high, p2, p4 = map(float, match.groups())
    assert low <= p1 <= high and p1 <= p2 <= p4
    evaluation.write_records(str(tmp_path / "eval.jsonl"), per_prompt)
    with open(tmp_path / "eval.jsonl") as f:
        records = [json.loads(row) for row in f]
    assert len(records) == 8 * 5 and {"response", "reward", "answer"} <= set(records[0])
    with pytest.raises(ConfigError, match="--k 8 needs --samples >= 8"):
        evaluation.parse_args(["--run", str(tmp_path), "--samples", "4", "--k", "8"])


def test_eval_usage_errors_come_before_anything_starts(tmp_path, capsys):
    """--k a, --k 0, --k -3, --samples 0, a flag the source does not read and a --temperature
    below rollout.temperature's bound (SGLang samples greedily under 1e-6,
    sglang/srt/sampling/sampling_params.py; -1 and nan fail every request) are usage errors
    (exit 2, a one-line reason) from the argument parser, before any config, model or engine is
    touched; an --out whose folder is missing is refused before the engine starts (it was found
    after every sample was drawn)."""
    for argv, reason in (
        (["--k", "a"], "expected comma-separated integers"),
        (["--k", "0"], "each k must be >= 1"),
        (["--k", "-3"], "each k must be >= 1"),
        (["--samples", "0"], "--samples 0: expected a count >= 1"),
        (["--temperature", "-1"], "--temperature -1.0: expected a finite value >= 0.01"),
        (["--temperature", "nan"], "--temperature nan: expected a finite value >= 0.01"),
        (["--temperature", "0.001"], "--temperature 0.001: expected a finite value >= 0.01"),
        # a flag the chosen source never reads (a reviewer found each dropped, silently)
        (["--config", "configs/tiny_tool.yaml"], "--config is --model's"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            evaluation.parse_args(["--run", str(tmp_path), *argv])
        assert exit_info.value.code == 2 and reason in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        evaluation.parse_args(["--model", str(tmp_path), "--step", "1"])
    assert exit_info.value.code == 2 and "use it with --run" in capsys.readouterr().err
    assert evaluation.parse_args(["--model", str(tmp_path)]).config == "configs/tiny.yaml"
    out = tmp_path / "missing" / "eval.jsonl"
    with pytest.raises(ConfigError, match="its folder does not exist or is not writable"):
        evaluation.main(["--model", str(tmp_path), "--out", str(out)])


def test_the_latest_checkpoint_is_matched_by_its_exact_name(tmp_path):
    """Only step_<digits> folders count, newest by step: a half-written .tmp and a copy someone
    named step_000200_copy2 are not checkpoints; a hand-made step_120 is found as named (it was
    looked for as step_000120) and, beside the one `save` writes for its step, is the older;
    run.keep_checkpoints removes by the names found, never a folder of a kept step."""
    import runtime.checkpoint as checkpoint

    for name in ("step_000050", "step_000100", "step_000200_copy2", "step_000300.tmp"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "checkpoints" / "step_000100")
    assert checkpoint.latest(str(tmp_path / "nowhere")) is None
    (tmp_path / "checkpoints" / "step_120").mkdir()
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "checkpoints" / "step_120")
    # a run resumed from it saves step 120 again, as `save` names it: that one is the newest,
    # and keeping one keeps both folders of its step
    (tmp_path / "checkpoints" / "step_000120").mkdir()
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "checkpoints" / "step_000120")
    # hand-made names of one step, none as `save` writes it: the last by name, whatever order
    # the set of names iterates in (it was the set's last, which PYTHONHASHSEED picks: this
    # test failed at 6 of seeds 0-7)
    for name in ("step_0121", "step_121", "step_00121", "step_000000121"):
        (tmp_path / "checkpoints" / name).mkdir()
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "checkpoints" / "step_121")
    for name in ("step_0121", "step_121", "step_00121", "step_000000121"):
        (tmp_path / "checkpoints" / name).rmdir()
    checkpoint.remove_old(str(tmp_path), keep=1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "step_000120",
        "step_000200_copy2",
        "step_000300.tmp",
        "step_120",
    ]


def test_eval_seeds_every_request(engine, policy, tmp_path, sent_seeds):
    """eval sends each request its own sampling_seed, as training does: with
    rollout.deterministic one seed for all would make a prompt's samples identical and pass@k
    collapse to pass@1."""
    cfg = tiny_config(tmp_path, "data.num_val_prompts=2", "rollout.max_new_tokens=4")
    tokenizer = model.load_tokenizer(cfg, "tiny")
    evaluation.run_eval(cfg, engine, tokenizer, 4, [1, 2], 1.0)
    assert len(sent_seeds) == 2 * 4 + 2 and None not in sent_seeds
    assert len(set(sent_seeds)) == len(sent_seeds)


def test_a_replayed_non_finite_step_is_exact_when_its_nans_are_the_logged_ones():
    """A step whose loss was NaN (skipped, train/skipped_updates) replays as exact when the replay
    gives the NaN training logged (NaN == NaN is False in Python) and the weights checkpoint N + 1
    holds; a number where training had a NaN, or weights unlike the next checkpoint's, is not
    exact; with no checkpoint N + 1 there is no verdict (None)."""
    nan = float("nan")
    assert replay.Replayed(nan, 1.5, nan, 1.5, "step_000003", 0).exact is True
    assert replay.Replayed(nan, nan, nan, nan, "step_000003", 0).exact is True
    # without checkpoint 3 the weights were not compared: not a verdict (another learning rate
    # gives the same figures)
    assert replay.Replayed(nan, nan, nan, nan, "step_000003", None).exact is None
    assert replay.Replayed(0.25, nan, nan, nan, "step_000003", None).exact is False
    assert replay.Replayed(0.25, 1.5, 0.25, 1.5, "step_000003", 2).exact is False


def test_replay_refuses_what_is_not_a_dump(tmp_path):
    """--replay of a missing folder, a truncated rank_0.pt and a file without a dump's keys each
    give a ConfigError naming the folder (they were a traceback: FileNotFoundError,
    UnpicklingError, KeyError). The file is read with weights_only, never unpickled."""
    with pytest.raises(ConfigError, match="no such folder"):
        replay.replay(str(tmp_path / "rollouts" / "step_000002"))
    # the step's number as a user may type it: the dumps there are named
    (tmp_path / "rollouts" / "step_000002").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"step_NNNNNN, six digits; .* holds \['step_000002'\]"):
        replay.replay(str(tmp_path / "rollouts" / "step_2"))
    (tmp_path / "rank_0.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(ConfigError, match="rank_0.pt does not load"):
        replay.replay(str(tmp_path))
    torch.save({"step": 2, "loss": 0.5}, tmp_path / "rank_0.pt")
    with pytest.raises(ConfigError, match="rank_0.pt is not a dump"):
        replay.replay(str(tmp_path))
    # a dump whose checkpoint to start from was pruned (run.keep_checkpoints) names that setting
    import dataclasses

    cfg = tiny_config(tmp_path, "run.checkpoint_every=1", "run.keep_checkpoints=2")
    dump = {"step": 2, "start_step": 0, "sequences": [], "loss": 0.5, "grad_norm": 1.0}
    folder = tmp_path / "rollouts" / "step_000002"
    torch.save(dump | {"config": dataclasses.asdict(cfg)}, folder / "rank_0.pt")
    with pytest.raises(ConfigError, match="checkpoint_every=1 and run.keep_checkpoints=0 to"):
        replay.replay(str(folder))
    # pruned as well when checkpoints are written less often (a reviewer found the message then
    # naming checkpoint_every alone)
    cfg = tiny_config(tmp_path, "run.checkpoint_every=5", "run.keep_checkpoints=2")
    torch.save(dump | {"config": dataclasses.asdict(cfg)}, folder / "rank_0.pt")
    with pytest.raises(ConfigError, match="checkpoint_every=1 and run.keep_checkpoints=0 to"):
        replay.replay(str(folder))


def test_a_run_folders_config_runs_no_model_code_unless_the_command_line_allows_it(tmp_path):
    """eval --run and --replay read a config from the folder, which may come from elsewhere: its
    model.trust_remote_code: true would run the Python files of its checkpoints as the model
    loads (a reviewer's auto_map did, through both). Refused before any model loads, unless
    --set model.trust_remote_code=true says so too."""
    import dataclasses

    import yaml

    cfg = tiny_config(tmp_path, "model.path=/elsewhere", "model.trust_remote_code=true")
    values = dataclasses.asdict(cfg)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError, match="trust_remote_code: true: loading its model runs"):
        evaluation.model_folder(evaluation.parse_args(["--run", str(tmp_path)]))
    allowed = ["--run", str(tmp_path), "--set", "model.trust_remote_code=true"]
    with pytest.raises(ConfigError, match="no checkpoint under"):  # past the check
        evaluation.model_folder(evaluation.parse_args(allowed))
    folder = tmp_path / "rollouts" / "step_000002"
    folder.mkdir(parents=True)
    dump = {"step": 2, "start_step": 0, "sequences": [], "loss": 0.5, "grad_norm": 1.0}
    torch.save(dump | {"config": values}, folder / "rank_0.pt")
    with pytest.raises(ConfigError, match="trust_remote_code: true: loading its model runs"):
        replay.replay(str(folder))
    with pytest.raises(ConfigError, match="no checkpoint .* to start from"):  # past the check
        replay.replay(str(folder), ["model.trust_remote_code=true"])
    # any other --set would change nothing (the dump's config is the step's): refused, not dropped
    with pytest.raises(ConfigError, match=r"--set \['train.lr=1'\] would change nothing"):
        replay.replay(str(folder), ["model.trust_remote_code=true", "train.lr=1"])
    with pytest.raises(ConfigError, match=r"as it ran: \['--out'\] read nothing"):
        train.main(["--replay", str(folder), "--out=elsewhere"])
    with pytest.raises(SystemExit):  # an abbreviation (argparse took --ou for --out) is unknown
        train.main(["--replay", str(folder), "--ou", "elsewhere"])


def test_a_dump_no_checkpoint_is_left_to_replay_from_is_removed(tmp_path, monkeypatch, caplog):
    """run.dump_rollouts wrote a folder a step that nothing removed, where run.keep_checkpoints
    bounds the checkpoints (a reviewer counted ~17 GB over 5,000 steps of configs/gsm8k.yaml's
    shape on 8 ranks). A dump goes once its checkpoint is gone, before the oldest kept; step 0's
    (replayed from the seeded initial policy) and the later ones stay. One that cannot be
    removed stays, with a warning, not an error out of the training step."""
    for step in (3, 4):
        (tmp_path / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    for step in range(6):
        (tmp_path / "rollouts" / f"step_{step:06d}").mkdir(parents=True)
    (tmp_path / "rollouts" / "notes").mkdir()  # not a dump: left alone
    replay.remove_unreplayable(str(tmp_path))
    left = sorted(os.listdir(tmp_path / "rollouts"))
    assert left == ["notes", "step_000000", "step_000003", "step_000004", "step_000005"]
    replay.remove_unreplayable(str(tmp_path / "no_run"))  # nothing saved yet: nothing to do
    # one that cannot be removed (an open file on NFS, say) stays; the step goes on
    (tmp_path / "rollouts" / "step_000001").mkdir()

    def busy(path):
        raise OSError(errno.EBUSY, "Device or resource busy")

    monkeypatch.setattr(replay.checkpoint, "remove", busy)
    replay.remove_unreplayable(str(tmp_path))
    assert "step_000001 stays: [Errno 16] Device or resource busy" in caplog.text


def test_a_dump_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch, caplog):
    """A full disk in run.dump_rollouts' write raised torch.save's RuntimeError out of the step
    (a traceback, the steps since the last checkpoint lost) and left its .tmp: now a warning,
    the .tmp removed, and only that step cannot be replayed."""
    cfg = tiny_config(tmp_path)

    def full_disk(obj, path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(replay.torch, "save", full_disk)
    replay.dump(cfg, 3, 0, [], {"train/loss": 0.5, "train/grad_norm": 1.0})
    assert "step 3's rollouts not dumped (it cannot be replayed): PytorchStreamWriter" in (
        caplog.text
    )
    assert os.listdir(tmp_path / "rollouts") == []  # no empty step folder left


def test_dumps_without_checkpoints_during_the_run_are_refused(tmp_path):
    """run.dump_rollouts with run.checkpoint_every=0: no dump could be replayed (each starts from
    the checkpoint of its step) and none was removed (remove_unreplayable waits for a checkpoint):
    0.41 MB a step a rank piled up, ~330 GB on 8 ranks over 100,000 steps (a reviewer's count)."""
    with pytest.raises(ConfigError, match="run.dump_rollouts=true with run.checkpoint_every=0"):
        tiny_config(tmp_path, "run.dump_rollouts=true", "run.checkpoint_every=0")
    assert tiny_config(tmp_path, "run.dump_rollouts=true", "run.checkpoint_every=10")
    # one step: step 0's dump replays from the seeded policy, the final checkpoint is its "after"
    assert tiny_config(
        tmp_path, "run.dump_rollouts=true", "run.checkpoint_every=0", "train.steps=1"
    )
