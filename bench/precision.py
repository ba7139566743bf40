"""Why the trainer keeps fp32 master weights: one training step at lr 1e-6 with bf16 compute,
through the trainer's own update.update_policy, against the same step with the parameters
themselves in bf16.

Prints the fraction of parameter elements the step changed in each arm. With one process the trainer
computes under autocast; under `torchrun --nproc-per-node N bench/precision.py` it shards the policy
with FSDP2 (MixedPrecisionPolicy), also with N=1. Runs on CPU (tiny model) or GPU (`--hidden 1536
--layers 4` is Qwen2.5-1.5B's width). Ends with: precision: lr=<f> compute=bfloat16
changed_fp32_masters=<f> changed_bf16_params=<f> ranks=<n> fsdp=<b> device=<s>
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

import dist_worker  # noqa: E402  (its fixed batch: uneven lengths, aborted rows)
import runtime.parallel as parallel  # noqa: E402
import assemble as setup_run  # noqa: E402
from train_step import train_on  # noqa: E402
import runtime.model as model  # noqa: E402
from assemble import load_config  # noqa: E402


def one_step(cfg, samples, advantages, device, params_dtype):
    """update.update_policy once from the seeded initial policy; returns (before, after) whole
    parameters."""
    policy, _ = model.build_policy(cfg, None)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    policy = policy.to(params_dtype)  # the bf16 arm: what the GPU config did before fp32 masters
    sharded = parallel.under_launcher()  # FSDP2 even with one rank, so torchrun exercises that path
    if sharded:
        policy = parallel.shard(policy, torch.bfloat16)
    policy.to(device)
    autocast_dtype = None if sharded else torch.bfloat16
    run = setup_run.trainer_only(cfg, policy, device, autocast_dtype)
    train_on(run, samples, advantages)
    after = {k: v.float().cpu() for k, v in parallel.full_state_dict(policy).items()}
    return before, after


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    device = (
        parallel.init()
        if parallel.under_launcher()
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    tiny = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml"
    )
    cfg = load_config(
        tiny,
        [
            f"train.lr={args.lr}",
            "train.weight_decay=0.01",
            "model.compute_dtype=bfloat16",
            f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={4 * args.hidden}",
            f"model.num_layers={args.layers}",
            "run.out=/tmp/precision",
        ],
    )
    samples, advantages = dist_worker.fixed_batch(num_groups=8)
    samples, advantages = parallel.rank_share(samples), parallel.rank_share(advantages)
    changed = {}
    for name, dtype in (("fp32_masters", torch.float32), ("bf16_params", torch.bfloat16)):
        before, after = one_step(cfg, samples, advantages, device, dtype)
        start = {k: v.to(dtype).float() for k, v in before.items()}  # what the arm started from
        changed[name] = sum(int((after[k] != start[k]).sum()) for k in start) / sum(
            v.numel() for v in start.values()
        )
    if parallel.rank() == 0:
        print(
            f"precision: lr={args.lr:g} compute=bfloat16 "
            f"changed_fp32_masters={changed['fp32_masters']:.4f} "
            f"changed_bf16_params={changed['bf16_params']:.4f} ranks={parallel.world_size()} "
            f"fsdp={parallel.under_launcher()} device={device.type}"
        )
    parallel.close()


if __name__ == "__main__":
    main()
