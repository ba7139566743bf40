"""Data parallelism on CPU: 2 gloo ranks, each with FSDP2 and its own real SGLang engine, against
one rank on the combined batch; precision (fp32 masters under bf16 compute); checkpoints across
world sizes; the launcher's handling of a failing rank. `python train.py` on 2 ranks (elastic
launch) and under torchrun run end to end in tests/test_gpu_readiness.py, on the shipped GSM8K
configs."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

import update
import runtime.checkpoint as checkpoint
import dist_worker
import launch_worker
import runtime.parallel as parallel
import train
import runtime.model as model
import runtime.lora as lora
from conftest import scratch, tiny_config, train_on

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# dist_worker.check_ranks on 2 ranks, in the background from collection on (conftest.py), in a
# folder it empties first (no earlier job's results to read): the job ends with rank 1's engine
# raising on purpose, and the script writes the launcher's RankError to rank_error.txt
TWO_RANKS = pathlib.Path(scratch("two_ranks"))
TWO_RANKS_JOB = f"""
import pathlib, shutil, sys
sys.path[:0] = [{REPO!r}, {os.path.join(REPO, "tests")!r}]
import dist_worker, runtime.parallel as parallel
out = pathlib.Path({str(TWO_RANKS)!r})
shutil.rmtree(out)
out.mkdir()
try:
    parallel.launch(2, dist_worker.check_ranks, str(out))
except parallel.RankError as error:
    (out / "rank_error.txt").write_text(str(error))
else:
    sys.exit("the 2-rank job ended without rank 1's error")
"""
ON_TWO_RANKS = pytest.mark.background("two_ranks", [sys.executable, "-c", TWO_RANKS_JOB])


@pytest.fixture(scope="module")
def two_ranks(background_runs):
    """(the job's folder, each rank's results, the launcher's RankError as text): the tests below
    read what the 2-rank job wrote."""
    background_runs.lines("two_ranks")
    error = (TWO_RANKS / "rank_error.txt").read_text()
    written = [TWO_RANKS / f"results_rank{r}.json" for r in range(2)]
    if not all(path.exists() for path in written):
        # the job failed before its planned end: its ranks' errors are the only clue, so show them
        pytest.fail(f"the 2-rank job ended early: {error}")
    return TWO_RANKS, [json.loads(path.read_text()) for path in written], error


@ON_TWO_RANKS
@pytest.mark.parametrize("mode, layout, compiled", dist_worker.PARITY_RUNS)
def test_two_ranks_update_equals_one_rank_on_the_combined_batch(
    two_ranks, tmp_path, mode, layout, compiled
):
    """Two ranks with uneven shares (rank 1 runs padding micro-batches), padded, packed or packed
    with each group's prompt shared, eager or with train.compile (whole layers under FSDP2), end
    one update with the loss, gradients and parameters of one eager padded rank on the combined
    batch."""
    out, _, _ = two_ranks
    samples, advantages = dist_worker.fixed_batch()
    assert any(s.masked for s in samples)
    policy, _, stats = dist_worker.update_once(
        dist_worker.parity_config(tmp_path, mode), samples, advantages, shard=False
    )
    initial, _ = model.build_policy(dist_worker.parity_config(tmp_path, mode), None)
    sharded = torch.load(out / dist_worker.parity_file(mode, layout, compiled), weights_only=True)
    assert sharded["loss"] == pytest.approx(stats["train/loss"], rel=1e-5, abs=1e-7)
    assert sharded["grad_norm"] == pytest.approx(stats["train/grad_norm"], rel=1e-5)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(sharded["grads"][name], p.grad, atol=1e-7, rtol=1e-4, msg=name)
    moved = 0
    for (name, expected), (_, start) in zip(
        policy.state_dict().items(), initial.state_dict().items()
    ):
        # Adam's first step divides by |grad|: where a gradient is ~1e-8, summation order alone
        # moves it
        torch.testing.assert_close(sharded["params"][name], expected, atol=1e-5, rtol=0, msg=name)
        moved += int((expected != start).sum())
    assert moved > 0.9 * sum(p.numel() for p in policy.parameters())  # the update really happened


@ON_TWO_RANKS
def test_lora_on_two_ranks_equals_one_rank_and_its_checkpoint_loads_on_one(two_ranks, tmp_path):
    """LoRA under FSDP2 (dist_worker.lora_under_fsdp): two ranks with uneven shares end one update
    with the adapters, gradients and loss of one rank on the combined batch; the checkpoint both
    ranks wrote holds the adapters alone (the base is frozen: no gradient, never saved), its peft
    folder holds them whole, and it loads on one rank; a bf16 base and fp32 adapters share the
    FSDP2 units; with the base as KL reference (the policy, adapters off) the policy is sharded
    too; a full-weight reference, which no backward reshards, is resharded after its forward."""
    out, results, _ = two_ranks
    sharded = torch.load(out / "lora_parity.pt", weights_only=True)
    samples, advantages = dist_worker.fixed_batch()
    cfg = dist_worker.parity_config(tmp_path, "token-mean", *dist_worker.LORA)
    policy, _, stats = dist_worker.update_once(cfg, samples, advantages, shard=False)
    assert sharded["loss"] == pytest.approx(stats["train/loss"], rel=1e-5, abs=1e-7)
    assert sharded["grad_norm"] == pytest.approx(stats["train/grad_norm"], rel=1e-5)
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert sorted(sharded["grads"]) == sorted(grads) and all(".lora_" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(sharded["grads"][name], grad, atol=1e-7, rtol=1e-4, msg=name)
    adapter = lora.adapter_tensors(policy)
    for name, tensor in adapter.items():
        torch.testing.assert_close(sharded["adapter"][name], tensor, atol=1e-5, rtol=0, msg=name)
    folder = sharded["checkpoint"]
    saved = safetensors.torch.load_file(os.path.join(folder, "adapter/adapter_model.safetensors"))
    assert all(torch.equal(saved[n], t) for n, t in sharded["adapter"].items())
    metadata = parallel.read_metadata(os.path.join(folder, "sharded")).state_dict_metadata
    assert all(".lora_" in k for k in metadata if k.startswith("model."))
    one, _ = model.build_policy(cfg, None)  # the 2-rank checkpoint, resharded onto one rank
    parallel.load_state(os.path.join(folder, "sharded"), one)
    assert all(torch.equal(lora.adapter_tensors(one)[n], t) for n, t in sharded["adapter"].items())
    assert results[0]["lora_bf16_dtypes"] == ["adapter torch.float32", "base torch.bfloat16"]
    assert results[0]["lora_bf16_trained"] == ["False", "True"]
    assert results[0]["lora_kl_sharded"] and results[1]["lora_kl_sharded"]
    assert results[0]["reference_resharded"] and results[1]["reference_resharded"]


@ON_TWO_RANKS
def test_fsdp_keeps_fp32_masters_under_bf16_compute(two_ranks):
    """Under FSDP2 with bf16 compute both ranks keep fp32 parameters and AdamW state, and an
    update at lr 1e-6 changes nearly every parameter (bf16 masters would keep ~98% unchanged)."""
    _, results, _ = two_ranks
    for r in results:
        assert r["param_dtypes"] == ["torch.float32"] and r["optimizer_dtypes"] == ["torch.float32"]
    assert results[0]["changed_fraction_bf16"] >= 0.99  # at lr 1e-6 a bf16 parameter would keep ~2%


def test_one_rank_bf16_compute_keeps_fp32_masters(engine, tmp_path):
    """On one rank with bf16 compute, set up as a run is (train.setup), the linear layers compute
    in bf16 (autocast) while parameters and AdamW state stay fp32, and an update at lr 1e-6
    changes at least 99% of the parameters."""
    cfg = tiny_config(tmp_path, "model.compute_dtype=bfloat16", "train.lr=1e-6")
    samples, advantages = dist_worker.fixed_batch()
    initial, _ = model.build_policy(cfg, None)
    run = train.setup(cfg, engine=engine)
    policy, optimizer = run.trainer.policy, run.trainer.optimizer
    computed = set()

    def linear_outputs(module, args, output):  # (the head returns fp32 log-probs in the update)
        if isinstance(module, torch.nn.Linear) and module is not policy.get_output_embeddings():
            computed.add(output.dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(linear_outputs)
    try:
        stats = train_on(run, samples, advantages)
    finally:
        hook.remove()
    assert computed == {torch.bfloat16}
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"} == {
        torch.float32
    }
    changed = sum(int((a != b).sum()) for a, b in zip(policy.parameters(), initial.parameters()))
    assert changed >= 0.99 * sum(p.numel() for p in policy.parameters())
    assert torch.isfinite(torch.tensor(stats["train/loss"]))


@ON_TWO_RANKS
def test_each_ranks_engine_scores_like_the_trainer_after_the_sync(two_ranks):
    """After one trained step and its weight sync, each rank's engine holds version 1, gives the
    trainer's log-probs (within 1e-4) and has no request left; each rank's GapWatch was given the
    largest rank's gap of the step (each watched its own: ranks could stop after different
    steps)."""
    _, results, _ = two_ranks
    for r in results:
        assert r["engine_version"] == 1  # one step trained and synced
        assert r["engine_gap"] < 1e-4
        assert r["num_in_flight"] == 0
    local = [r["gaps"]["local"] for r in results]
    assert len(local[0]) == len(local[1]) >= 1
    largest = [max(gaps) for gaps in zip(*local)]
    assert results[0]["gaps"]["watched"] == results[1]["gaps"]["watched"] == largest


@ON_TWO_RANKS
def test_checkpoint_of_two_ranks_resumes_with_two_and_loads_with_one(two_ranks, engine):
    """A 2-rank checkpoint holds both ranks' suspended samples (partial rollout), resumes on 2
    ranks with equal parameters and optimizer state, resumes resharded on one rank with the
    trained parameters and AdamW moments, and its HF export scores like the resumed trainer."""
    out, results, _ = two_ranks
    suspended = [r["buffer_samples"] for r in results]
    assert sum(suspended) > 0 and all(r["saved_buffer_samples"] == sum(suspended) for r in results)
    assert all(
        r["resumed_step"] == 1 and r["resumed_params_equal"] and r["resumed_optimizer_equal"]
        for r in results
    )
    run_dir = out / "run"
    trained = torch.load(out / "params_trained.pt", weights_only=True)
    cfg = tiny_config(run_dir, "rollout.prompts_per_step=4", "train.steps=2")
    one = train.setup(cfg, resume=True, engine=engine)  # resharded by torch.distributed.checkpoint
    assert one.start_step == 1
    assert all(torch.equal(trained[name], p) for name, p in one.trainer.policy.state_dict().items())
    assert one.trainer.optimizer.state  # AdamW moments came back too
    # the HF export loads with from_pretrained and scores like the resumed trainer
    exported = AutoModelForCausalLM.from_pretrained(
        checkpoint.latest(str(run_dir)), dtype=torch.float32
    )
    samples, _ = dist_worker.fixed_batch()
    batch = update.collate(samples, pad_id=0)
    with torch.no_grad():
        expected, _ = update.sequence_logprobs(one.trainer.policy, batch, 1.0)
        got, _ = update.sequence_logprobs(exported, batch, 1.0)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@ON_TWO_RANKS
def test_rank_0_logs_the_step_once_with_counts_summed_over_the_ranks(two_ranks):
    """The 2-rank step's TensorBoard events: rank 0 alone writes them (one value per step), the
    launch count is both ranks' (4 prompts x 8), and the fastest rank's rollout time is beside the
    slowest's."""
    from test_train import scalars

    out, _, _ = two_ranks
    logged = scalars(out / "run")
    assert len(logged["train/loss"]) == 1 and logged["rollout/launched"] == [4 * 8]
    assert logged["timing/rollout_s_min"][0] <= logged["timing/rollout_s"][0]


@ON_TWO_RANKS
def test_a_control_call_on_an_engine_that_dies_raises_within_the_liveness_tick(two_ranks):
    """Rank 0 froze its scheduler, started flush_cache (SGLang's own call would wait on a reply
    forever, managers/communicator.py), and SIGKILLed the scheduler a second later: the call
    raises at the next twice-a-second liveness check."""
    out, _, _ = two_ranks
    result = json.loads((out / "control_call.json").read_text())
    assert result["message"].startswith("the SGLang engine died: scheduler_0"), result
    assert result["seconds_after_kill"] < 2.0, result


@ON_TWO_RANKS
def test_an_engine_that_raises_on_one_rank_ends_the_job_with_its_message(two_ranks):
    """Rank 1's scheduler raised on a pushed tensor and sent SIGQUIT to its rank: the rank raised
    EngineDiedError (SGLang's handler would have SIGKILLed it: "Signal 9", no message) and the
    launcher ended the job with it."""
    _, _, error = two_ranks
    assert "rank 1:" in error and "the SGLang engine died: scheduler_0" in error, error
    assert "raised an exception and sent SIGQUIT" in error, error


def test_ranks_on_several_hosts_are_refused():
    """torchrun over two nodes: rank 0 alone renames each checkpoint into place and writes the
    engines' model folder, which the other node's disk never sees. parallel.init gathers every
    rank's host name and refuses several (a reviewer read it; it needs two nodes to fail for
    real). The host names decide, not the launcher's node count: srun with a task per GPU runs
    torchrun --nnodes=N on one host."""
    parallel.one_node(["gpu-node-1"] * 4)
    with pytest.raises(parallel.RankError, match="ranks on 2 hosts \\(a, b\\)"):
        parallel.one_node(["a", "a", "b", "b"])


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    """A rank that raises ends the 2-rank job with a RankError carrying that rank's message. The
    launcher's signal handlers are left as they were (torch elastic's SIGQUIT and SIGHUP ones
    stayed: an engine's SIGQUIT handler in the process was torch's SignalException after)."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    before = [signal.getsignal(sig) for sig in signals]
    with pytest.raises(parallel.RankError, match="rank 1 could not go on"):
        parallel.launch(2, launch_worker.fail_on_rank_1, str(tmp_path))
    assert [signal.getsignal(sig) for sig in signals] == before


def test_a_ctrl_c_before_a_ranks_handler_returns_sigint_instead_of_hanging(tmp_path):
    """A rank whose Ctrl-C raised KeyboardInterrupt (before StopSignal is in) returns "SIGINT",
    as one stopped by a signal does: train.py then says the run stopped. (torch's process wrapper
    took it for its parent's kill and exited without a result, and the launch waited forever.)"""
    assert parallel.launch(2, launch_worker.interrupted, str(tmp_path)) == {
        0: "SIGINT",
        1: "SIGINT",
    }


LAUNCH_AND_REPORT = """
import json, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import launch_worker, runtime.parallel as parallel
print(json.dumps(parallel.launch(2, launch_worker.count_signals, {out!r})), flush=True)
"""


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C to the process group"])
def test_the_launcher_leaves_a_signal_to_its_ranks(tmp_path, how):
    """`python train.py` with run.nproc > 1 (parallel.launch): a SIGTERM to the launcher reaches
    each rank once; a Ctrl-C reaches each rank from the terminal and once more from the launcher
    (StopSignal takes that repeat as the same signal). Either way the ranks finish on their own
    and the launch returns their results, no traceback (torch elastic handled the signals: it sent
    them again, SIGKILLed the ranks 30 s later and raised SignalException, exit 1)."""
    script = LAUNCH_AND_REPORT.format(
        repo=REPO, tests=os.path.join(REPO, "tests"), out=str(tmp_path)
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready_*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    if how.startswith("SIGTERM"):
        os.kill(process.pid, signal.SIGTERM)
        expected = [["SIGTERM"]]
    else:  # two SIGINTs pending at once are delivered as one (signals do not queue)
        os.killpg(process.pid, signal.SIGINT)
        expected = [["SIGINT"], ["SIGINT", "SIGINT"]]
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Traceback" not in err, err[-2000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert sorted(got) == ["0", "1"] and all(g in expected for g in got.values()), got


def test_train_py_reports_a_rank_error_and_exits_non_zero(tmp_path):
    """`train.py` on 2 ranks whose setup raises on each rank (a model folder that does not exist)
    exits non-zero with a RankError and the rank's message, one line: a reviewer found torch
    elastic's error record, a dict holding the traceback as escaped text, in its place."""
    command = [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny.yaml",
        "--out",
        str(tmp_path),
        "--set",
        "run.nproc=2",
        "--set",
        "model.path=/nonexistent/model",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error: RankError")]
    # (the rank that fails first, either one)
    assert re.search(r"rank \d: ModelError: model.path='/nonexistent/model' could not be", line)
    assert "Traceback" not in line and "extraInfo" not in line, line
