"""FSDP2 gradient sync per micro-batch (what train.py does) against once per minibatch
(`set_requires_gradient_sync(False)` on all but the last micro-batch), 2 ranks on CPU (gloo).

Each rank runs one full update (update.update_policy: old log-probs, then the minibatch) on its
own GSM8K-like samples (bench/train_step.py's mix and Qwen2-shaped model; `--samples`, 32 by
default, half of one rank's share of configs/gsm8k.yaml, to keep 2 CPU ranks quick; packed under
a 4,096-token budget), the arms alternated, medians of
`--repeats`. The "minibatch" arm switches the sync off before every grad-enabled forward but the
minibatch's last (a forward pre-hook: the flag is read when the backward reduces), so the gradients
accumulate unsharded and are reduce-scattered once. Both arms must end at the same parameters
(printed: the largest difference). Memory is not measured here: on a GPU the unsharded fp32
gradients are what it costs (bench/estimate_memory.py's arithmetic). Run from the repo root: `python
bench/grad_sync.py`; the last line: grad_sync: micro_batch_s=<f> minibatch_s=<f> speedup=<f>
max_param_diff=<g>
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
# train_step.py's mix (after the root: bench/merge.py)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from advantages import group_advantages  # noqa: E402
import runtime.parallel as parallel  # noqa: E402
import assemble as setup_run  # noqa: E402
import train_step  # noqa: E402
from assemble import load_config  # noqa: E402


def update(samples, once_per_minibatch, micro_batches, max_tokens=0):
    """One update of the seeded sharded model (`max_tokens`: the token budget, 0 = the config's);
    returns (seconds, local micro-batch count, full parameters)."""
    cfg = load_config(
        os.path.join(train_step.ROOT, "configs/gsm8k.yaml"), train_step.MIXES["gsm8k"][1]
    )
    cfg.train.max_tokens_per_micro_batch = max_tokens or cfg.train.max_tokens_per_micro_batch
    policy = parallel.shard(train_step.policy_for("gsm8k", cfg), torch.float32)
    # num_minibatches is 1 here: the update's last grad-enabled forward syncs
    if once_per_minibatch:
        calls = [0]

        def sync_last_only(module, args, kwargs):
            if torch.is_grad_enabled():
                calls[0] += 1
                module.set_requires_gradient_sync(calls[0] == micro_batches)

        policy.register_forward_pre_hook(sync_last_only, with_kwargs=True)
    run = setup_run.trainer_only(cfg, policy)
    advantages, _ = group_advantages(
        torch.randn(len(samples), generator=torch.Generator().manual_seed(0)),
        torch.tensor([s.group_id for s in samples]),
        torch.ones(len(samples), dtype=torch.bool),
    )
    torch.distributed.barrier()
    start = time.perf_counter()
    stats = train_step.train_on(run, samples, advantages)
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    return (
        seconds,
        stats["train/micro_batches"],
        [parallel.full_tensor(p.detach()).clone() for p in policy.parameters()],
    )


def rank_main(num_samples, repeats, max_tokens):
    parallel.init()
    torch.set_num_threads(1)  # two ranks on two cores
    samples = train_step.gsm8k_samples(num_samples, seed=parallel.rank())
    # warm-up, and the micro-batch count
    _, micro_batches, _ = update(samples, False, 0, max_tokens)
    seconds, params = {False: [], True: []}, {}
    for repeat in range(repeats):
        for once in ((False, True) if repeat % 2 == 0 else (True, False)):
            elapsed, _, params[once] = update(samples, once, micro_batches, max_tokens)
            seconds[once].append(parallel.all_reduce([elapsed], op="max")[0])
    diff = max((a - b).abs().max().item() for a, b in zip(params[False], params[True]))
    parallel.close()
    return statistics.median(seconds[False]), statistics.median(seconds[True]), micro_batches, diff


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32, help="samples per rank")
    parser.add_argument("--repeats", type=int, default=3, help="alternated pairs")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="token budget per micro-batch (0: the config's 4,096)",
    )
    args = parser.parse_args()
    results = parallel.launch(2, rank_main, args.samples, args.repeats, args.max_tokens)
    every, once, micro_batches, diff = results[0]
    print(
        f"{micro_batches} micro-batches per rank per update; per update (the slower rank): "
        f"sync every micro-batch {every:.3f} s, once per minibatch {once:.3f} s"
    )
    print(
        f"grad_sync: micro_batch_s={every:.3f} minibatch_s={once:.3f} "
        f"speedup={every / once:.3f} max_param_diff={diff:.3g}"
    )


if __name__ == "__main__":
    main()
