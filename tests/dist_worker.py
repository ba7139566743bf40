"""What each rank runs in tests/test_distributed.py (the launcher pickles these functions by
reference, so they live in a module the spawned ranks can import). Every function here is a real
rank's job: FSDP2 over gloo, a real SGLang engine per rank, results written as files for the test
to check."""

import dataclasses
import json
import os
import signal
import sys
import threading
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# absolute: ranks may start in any directory
TINY_CONFIG = os.path.join(REPO, "configs", "tiny.yaml")
sys.path.insert(0, REPO)

import update  # noqa: E402
import memory  # noqa: E402
import runtime.checkpoint as checkpoint  # noqa: E402
import loss as losses  # noqa: E402
from advantages import group_advantages  # noqa: E402
import runtime.parallel as parallel  # noqa: E402
import runtime.engine as sglang_engine  # noqa: E402
import assemble as setup_run  # noqa: E402
import train  # noqa: E402
from conftest import train_on  # noqa: E402
import rollout  # noqa: E402
import runtime.model as model  # noqa: E402
import runtime.lora as lora  # noqa: E402
from assemble import load_config  # noqa: E402
from task.data import PromptStream  # noqa: E402
from sample import Sample  # noqa: E402

MODES = losses.LOSS_AGG_MODES
# (loss mode, layout, train.compile): the parity runs, each loss mode padded, two of them packed
# under a 20-token budget, one packed with whole decoder layers compiled under FSDP2, as
# configs/gsm8k.yaml does on 8 GPUs (Inductor on CPU: ~25 s cold), and one packed with each
# group's prompt shared (train.shared_prefix)
PARITY_RUNS = [(mode, "padded", False) for mode in MODES] + [
    ("token-mean", "packed", False),
    ("seq-mean-token-mean", "packed", False),
    ("token-mean", "packed", True),
    ("token-mean", "shared", False),
]
PACKED = "train.max_tokens_per_micro_batch=20"
LAYOUTS = {"padded": [], "packed": [PACKED], "shared": [PACKED, "train.shared_prefix=true"]}
LORA = ("model.lora_rank=4", "model.lora_alpha=8")


def fixed_batch(num_groups=4, group_size=4, seed=0):
    """GRPO groups (a prompt each) of responses of uneven lengths, aborted rows among them, and
    their advantages: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group_id in range(num_groups):
        prompt = torch.randint(
            4, 25, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g
        ).tolist()
        for member in range(group_size):
            response = torch.randint(
                4, 25, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g
            ).tolist()
            logprobs = (-torch.rand(len(response), generator=g) * 3).tolist()
            masked = (group_id + member) % 3 == 0  # a third of the rows, in every group
            samples.append(
                Sample(
                    prompt,
                    response,
                    logprobs,
                    [1] * len(response),
                    group_id,
                    trajectory_id=len(samples),
                    masked=masked,
                    finish_reason="abort" if masked else "stop",
                )
            )
    rewards = torch.rand(len(samples), generator=g)
    advantages, _ = group_advantages(
        rewards,
        torch.tensor([s.group_id for s in samples]),
        torch.tensor([not s.masked for s in samples]),
    )
    return samples, advantages


def update_once(cfg, samples, advantages, shard):
    """One update_policy from the seeded initial policy; returns the policy (sharded if
    `shard`)."""
    policy, _ = model.build_policy(cfg, None)
    compute_dtype = getattr(torch, cfg.model.compute_dtype)
    if shard:
        policy = parallel.shard(policy, compute_dtype)
    autocast_dtype = None if shard or compute_dtype == torch.float32 else compute_dtype
    run = setup_run.trainer_only(cfg, policy, autocast_dtype=autocast_dtype)
    stats = train_on(run, samples, advantages)
    return policy, run.optimizer, stats


def parity_file(mode, layout, compiled):
    return f"params_{mode}{'' if layout == 'padded' else '_' + layout}{'_compiled' * compiled}.pt"


def parity_config(out_dir, mode, *sets):
    """tiny.yaml for the parity runs, whose padded layout has micro-batches of 3 rows (set after
    the load: a packed layout, which tests switch to the padded one and back, leaves it unread)."""
    cfg = load_config(TINY_CONFIG, [f"run.out={out_dir}", f"train.loss_agg={mode}", *sets])
    if not any(item.startswith("train.micro_batch_size=") for item in sets):
        cfg.train.micro_batch_size = 3
    return cfg


def local_share(samples, advantages):
    """Rank 0 takes groups 0-2, rank 1 group 3: uneven shares, so rank 1 runs padding
    micro-batches."""
    groups = {0, 1, 2} if parallel.rank() == 0 else {3}
    rows = [i for i, s in enumerate(samples) if s.group_id in groups]
    return [samples[i] for i in rows], advantages[rows]


def full_params(policy):
    return {name: tensor.clone() for name, tensor in parallel.full_state_dict(policy).items()}


def full_grads(policy):
    """The (clipped) gradients the update used, whole. Adam's first step is nearly sign(grad) and
    clipping rescales, both blind to a wrong gradient scale: the test compares these, the loss
    and the pre-clip gradient norm too (a mean instead of a sum over ranks shows in the norm)."""
    return {name: parallel.full_tensor(p.grad).clone() for name, p in policy.named_parameters()}


def check_ranks(out_dir):
    """The 2-rank job: parity per loss mode, bf16 precision, a real training step (engine per
    rank, weight sync, checkpoint), engine-vs-trainer scoring after the sync, and resuming with 2
    ranks."""
    parallel.init()
    rank, results = parallel.rank(), {}
    samples, advantages = fixed_batch()
    mine, my_advantages = local_share(samples, advantages)
    # one update from the same start, this rank's share of the fixed batch
    for mode, layout, compiled in PARITY_RUNS:
        cfg = parity_config(out_dir, mode, *LAYOUTS[layout], f"train.compile={compiled}")
        policy, _, stats = update_once(cfg, mine, my_advantages, shard=True)
        params, grads = full_params(policy), full_grads(policy)
        if rank == 0:
            torch.save(
                {
                    "params": params,
                    "grads": grads,
                    "loss": stats["train/loss"],
                    "grad_norm": stats["train/grad_norm"],
                },
                os.path.join(out_dir, parity_file(mode, layout, compiled)),
            )

    lora_under_fsdp(out_dir, mine, my_advantages, results)

    # precision: bf16 compute over fp32 master weights and fp32 AdamW state, an update at lr 1e-6
    # lands
    cfg = parity_config(out_dir, "token-mean", "model.compute_dtype=bfloat16", "train.lr=1e-6")
    # the initial weights
    before = full_params(parallel.shard(model.build_policy(cfg, None)[0], torch.bfloat16))
    policy, optimizer, _ = update_once(cfg, mine, my_advantages, shard=True)
    after = full_params(policy)
    if rank == 0:
        changed = sum(int((after[k] != before[k]).sum()) for k in before)
        results["changed_fraction_bf16"] = changed / sum(v.numel() for v in before.values())
    results["param_dtypes"] = sorted({str(p.to_local().dtype) for p in policy.parameters()})
    results["optimizer_dtypes"] = sorted(
        {
            str(v.to_local().dtype)
            for s in optimizer.state.values()
            for k, v in s.items()
            if k != "step"
        }
    )

    # a real step through the loop: rollout on each rank's engine (the cancelled tail suspended:
    # partial rollout), update, weight sync, log, checkpoint
    run_dir = os.path.join(out_dir, "run")
    cfg = load_config(
        TINY_CONFIG,
        [
            f"run.out={run_dir}",
            "rollout.prompts_per_step=4",
            "data.num_val_prompts=8",
            "train.steps=1",
            "run.val_every=100",
            "rollout.cancel=count",
            "rollout.drop_rate=0.25",
            "rollout.partial=true",
            "train.tis_cap=2",
            # a KV pool of about five requests: each rank's tail queues and is still in its engine
            # at the count, so something is suspended even on a loaded machine (test_partial)
            "rollout.max_total_tokens=256",
        ],
    )
    run = train.setup(cfg)
    # the log-prob gap each rank measured, and the one its GapWatch was given (the ranks' largest)
    gaps = {"local": [], "watched": []}
    sync, observe = memory.sync_weights, run.gap_watch.observe

    def recording_sync(run, step, logprob_gap=None):
        gaps["local"].append(logprob_gap.value)  # (every rank trained fresh tokens here)
        return sync(run, step, logprob_gap=logprob_gap)

    def recording_observe(step, gap):
        gaps["watched"].append(gap)
        observe(step, gap)

    memory.sync_weights, run.gap_watch.observe = recording_sync, recording_observe
    try:
        train.train(run)
    except BaseException:
        # the engine's scheduler processes are not daemons: left running, the rank would wait for
        # them at exit and the suite would hang instead of failing with this error
        run.engine.shutdown()
        raise
    memory.sync_weights = sync
    results["gaps"] = gaps
    # the checkpoint holds both ranks' suspended samples
    results["buffer_samples"] = len(run.buffer.waiting)
    state = checkpoint.read_trainer_state(checkpoint.latest(run_dir))
    results["saved_buffer_samples"] = len(state["buffer"]["waiting"])
    # the engine now holds the updated weights: it must score its own samples like the trainer does
    prompts = parallel.rank_share(run.val_prompts)
    fresh, _ = rollout.generate_scored(run, prompts, 2, 1.0)
    batch = update.collate(fresh, pad_id=0)
    with torch.no_grad():
        trainer_logprobs, _ = update.sequence_logprobs(run.trainer.policy, batch, 1.0)
    gap = ((trainer_logprobs - batch["engine_logprobs"]).abs() * batch["loss_mask"]).max().item()
    results["engine_gap"] = gap
    results["engine_version"] = run.engine.weight_version
    results["num_in_flight"] = run.engine.num_in_flight()
    trained = full_params(run.trainer.policy)
    if rank == 0:
        torch.save(trained, os.path.join(out_dir, "params_trained.pt"))

    # resume with 2 ranks from the checkpoint the step wrote: same parameters and optimizer state
    resumed = train.setup(
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2)),
        resume=True,
        engine=run.engine,
    )
    results["resumed_step"] = resumed.start_step
    results["resumed_params_equal"] = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(run.trainer.policy.parameters(), resumed.trainer.policy.parameters())
    )
    results["resumed_optimizer_equal"] = all(
        torch.equal(
            (
                run.trainer.optimizer.state[a][k].to_local()
                if k != "step"
                else run.trainer.optimizer.state[a][k]
            ),
            (
                resumed.trainer.optimizer.state[b][k].to_local()
                if k != "step"
                else resumed.trainer.optimizer.state[b][k]
            ),
        )
        for a, b in zip(run.trainer.policy.parameters(), resumed.trainer.policy.parameters())
        for k in run.trainer.optimizer.state[a]
    )
    with open(os.path.join(out_dir, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f)

    # engine faults, last (each rank's engine is done with): rank 0's scheduler dies while a control
    # call waits on it; then rank 1's scheduler raises on a pushed tensor, which must end the job
    # with its message
    try:
        if rank == 0:
            message, seconds = control_call_while_the_scheduler_dies(run.engine)
            with open(os.path.join(out_dir, "control_call.json"), "w") as f:
                json.dump({"message": message, "seconds_after_kill": seconds}, f)
        parallel.barrier()
        if rank == 1:
            name = next(iter(run.engine.weight_shapes))
            run.engine.update_weights(rejected_tensor(run.engine, name), version=99)
    finally:
        run.engine.shutdown()
    parallel.close()


def lora_under_fsdp(out_dir, mine, my_advantages, results):
    """LoRA on 2 ranks: the adapters sharded like every parameter, the base frozen. One update on
    this rank's share (fp32), its checkpoint (the adapters and their AdamW state, written by both
    ranks; rank 0 writes the adapter folder, gathered), the whole adapters and their gradients for
    the test to compare with one rank; then the dtypes of a bf16 run (a bf16 base beside fp32
    adapters in one FSDP2 unit)."""
    cfg = parity_config(out_dir, "token-mean", *LORA)
    policy, tokenizer = model.build_policy(cfg, None)
    policy = parallel.shard(policy, torch.float32)
    trainer = setup_run.trainer_only(cfg, policy)
    stats = train_on(trainer, mine, my_advantages)
    adapter = lora.adapter_tensors(policy, gather=parallel.full_tensor)
    grads = {
        name: parallel.full_tensor(p.grad).clone()
        for name, p in policy.named_parameters()
        if p.grad is not None
    }
    stream = PromptStream.for_rank([], 0, parallel.rank(), parallel.world_size())
    run = setup_run.Run(cfg=cfg, trainer=trainer, tokenizer=tokenizer, stream=stream)
    folder = checkpoint.save(os.path.join(out_dir, "lora_run"), 1, run)
    if parallel.rank() == 0:
        torch.save(
            {
                "adapter": adapter,
                "grads": grads,
                "loss": stats["train/loss"],
                "grad_norm": stats["train/grad_norm"],
                "checkpoint": folder,
            },
            os.path.join(out_dir, "lora_parity.pt"),
        )
    cfg = parity_config(out_dir, "token-mean", *LORA, "model.compute_dtype=bfloat16")
    policy, _, _ = update_once(cfg, mine, my_advantages, shard=True)
    results["lora_bf16_dtypes"] = sorted(
        {
            f"{'adapter' if '.lora_' in n else 'base'} {p.to_local().dtype}"
            for n, p in policy.named_parameters()
        }
    )
    results["lora_bf16_trained"] = sorted({str(p.requires_grad) for p in policy.parameters()})
    # with a KL reference that is the LoRA base (the policy, adapters off) the policy is sharded
    # all the same: unsharded, each rank would step on its own gradients
    cfg = parity_config(out_dir, "token-mean", *LORA, "train.kl_coef=0.1")
    placed, reference = setup_run.place_models(
        cfg, model.build_policy(cfg, None)[0], torch.float32, torch.device("cpu")
    )
    results["lora_kl_sharded"] = (
        all(type(p.data).__name__ == "DTensor" for p in placed.parameters())
        and reference.policy is placed
    )
    # a full-weight KL reference runs no-grad forwards only, so no backward reshards its root:
    # place_models has it reshard after forward (its root stayed gathered through the update)
    cfg = parity_config(out_dir, "token-mean", "train.kl_coef=0.1")
    _, reference = setup_run.place_models(
        cfg, model.build_policy(cfg, None)[0], torch.float32, torch.device("cpu")
    )
    with torch.no_grad():
        reference(torch.tensor([[4, 5, 6, 7]]))
    results["reference_resharded"] = all(
        type(p.data).__name__ == "DTensor" for p in reference.parameters()
    )


def rejected_tensor(engine, name):
    """[(name, a tensor of the wrong shape)], with the trainer's own shape check told it is
    right: the engine's scheduler gets it and raises inside its weight loader (a Python
    exception, like a CUDA OOM there)."""
    engine.weight_shapes[name] = (3, 3)
    return [(name, torch.zeros(3, 3))]


def control_call_while_the_scheduler_dies(engine, kill_after_s=1.0):
    """Freeze the scheduler (SIGSTOP: alive, never answering), start a control call
    (flush_cache), SIGKILL the scheduler `kill_after_s` later. Returns (the error the call
    raised, seconds from the kill to the error); a call that never returns is ended by SIGALRM
    after 60 s, failing this rank."""
    pid = engine._engine_processes[0][0].pid
    os.kill(pid, signal.SIGSTOP)
    killed_at = []
    timer = threading.Timer(
        kill_after_s, lambda: (killed_at.append(time.monotonic()), os.kill(pid, signal.SIGKILL))
    )
    timer.start()
    signal.alarm(60)
    try:
        engine.flush_cache()
        return "returned", None
    except sglang_engine.EngineDiedError as e:
        return str(e), time.monotonic() - killed_at[0]
    finally:
        signal.alarm(0)
        timer.cancel()
