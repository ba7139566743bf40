"""Benchmark for tail cancellation: rollout wall time with the long tail cancelled vs waited for,
(`--partial`) useful tokens per second over a multi-step workload for no cancellation, dropping the
tail, and partial rollout (the tail suspended and continued next step, partial.py), and (`--filter`)
kept groups per rollout second for three ways to collect a batch of informative groups (dynamic
sampling).

One real SGLang engine (CPU) serves a random-init tiny model whose lengths are geometric (median
~11, a few samples several times longer); the arms alternate on the same prompts, medians of repeats
are reported. Run from the repo root: `python bench/tail.py [--partial]`. The last line is the
machine-readable summary.
"""

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile

import torch

# Run as a script from anywhere: make the repo root (this file's parent's parent) importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import task.data as tasks  # noqa: E402  (needs the sys.path line above)
import task.tiny as tiny
import sample  # noqa: E402
import runtime.checkpoint as checkpoint  # noqa: E402
import runtime.model as model  # noqa: E402
from assemble import load_config  # noqa: E402
from partial import PartialBuffer  # noqa: E402
from cancel import informative_groups, plan_launch  # noqa: E402
from rollout import RolloutEngine  # noqa: E402


def ideal_speedup(samples, plan):
    """Best case, from a full rollout: time the last sample came back / time the plan's target did
    (latency_s counts from launch). For `group` a group is back when its slowest member is.
    On CPU a decode step costs ~4.5 ms + ~0.2 ms per running request, so the thinned-out tail runs
    cheaply: the last sample is ~4x the p80 in tokens but only ~1.5x in time."""
    if plan.cancel == "group":
        group_done = {}
        for s in samples:
            group_done[s.group_id] = max(group_done.get(s.group_id, 0.0), s.latency_s)
        times, kept_fraction = sorted(group_done.values()), plan.target_groups / plan.num_prompts
    else:
        times = sorted(s.latency_s for s in samples)
        kept_fraction = plan.target_samples / (plan.num_prompts * plan.group_size)
    # over-sampling: the kept share of this batch
    target = max(1, round(kept_fraction * len(times)))
    return times[-1] / times[target - 1]


def run_arm(engine, prompts, args, plan):
    """One rollout; returns (samples, stats, wasted tokens = response tokens of aborted samples)."""
    # Start from an empty prefix cache, as every training step does (weight sync flushes it); a
    # cache full of the previous arm's sequences makes the next arm pay for evictions (measured: the
    # second arm of each pair was up to 1.5x slower, whichever arm it was).
    engine.flush_cache()
    samples, stats = engine.generate(
        prompts, args.group_size, args.temperature, args.max_new_tokens, plan
    )
    assert engine.num_in_flight() == 0, "a rollout left requests in the engine"
    # wasted: generated, then thrown away (the drop policy does not resume partial samples)
    return samples, stats, sum(len(s.response_ids) for s in samples if s.masked)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per rollout (the batch)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="high enough not to cut the tail flat"
    )
    parser.add_argument(
        "--max-positions", type=int, default=512, help="model.max_position_embeddings"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--policy", default="count", choices=("count", "time", "group"))
    parser.add_argument(
        "--drop-rate", type=float, help="default 0.2 (0 with --partial or --over-sample-rate)"
    )
    parser.add_argument(
        "--over-sample-rate", type=float, help="use with --drop-rate 0; --partial's default 0.25"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="baseline/cancel pairs, alternated (default 5); --partial: "
        "whole multi-step workloads, each with a fresh buffer (default 3)",
    )
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="OMP threads of each engine process"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--partial", action="store_true", help="multi-step: baseline vs drop vs partial rollout"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="--partial: steps per arm, the arms alternated"
    )
    parser.add_argument(
        "--max-staleness", type=int, default=4, help="--partial: rollout.max_staleness"
    )
    parser.add_argument(
        "--filter",
        action="store_true",
        help="dynamic sampling: rounds vs wait-all vs filter + abort",
    )
    parser.add_argument(
        "--round-prompts",
        type=int,
        help="--filter: prompts per synchronous round (default 3x --prompts)",
    )
    parser.add_argument(
        "--launch-prompts",
        type=int,
        help="--filter: the streaming arms' first launch (default: "
        "--round-prompts, so every arm starts alike and they differ in how they stop and refill)",
    )
    args = parser.parse_args()
    if (args.partial or args.filter) and args.drop_rate is None and args.over_sample_rate is None:
        # APRIL's over-provisioning (arXiv 2509.18521): launch 1.25x the prompts, stop at a batch,
        # suspend the rest
        args.over_sample_rate = 0.25
    args.over_sample_rate = args.over_sample_rate or 0.0
    args.round_prompts = args.round_prompts or 3 * args.prompts
    args.launch_prompts = args.launch_prompts or args.round_prompts
    if args.repeats is None:
        args.repeats = 3 if args.partial else 5
    if args.drop_rate is None:
        args.drop_rate = 0.0 if args.over_sample_rate else 0.2

    torch.set_num_threads(1)  # this process shares the 2 cores with the engine's scheduler process
    out_dir = tempfile.mkdtemp(prefix="bench-tail-")
    cfg = load_config(
        args.config,
        [
            f"run.out={out_dir}",
            f"train.seed={args.seed}",
            f"model.max_position_embeddings={args.max_positions}",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.engine_threads={args.engine_threads}",
        ],
    )
    policy, tokenizer = model.build_policy(cfg, None)
    model_dir = checkpoint.export_for_engine(policy, tokenizer, out_dir)
    plan = plan_launch(
        dataclasses.replace(
            cfg.rollout,
            cancel=args.policy,
            drop_rate=args.drop_rate,
            over_sample_rate=args.over_sample_rate,
        ),
        args.prompts,
    )
    # over-sampling launches more prompts than the batch; the baseline launches just the batch
    drawn = [
        p.prompt_ids
        for p in tiny.draw(tokenizer, plan.num_prompts, cfg.data.tiny_max_count, args.seed)
    ]
    base_prompts, cancel_prompts = drawn[: args.prompts], drawn
    # SGLang admits a request only if the KV pool can hold ~0.7 x max_new_tokens for every running
    # one; the default 16k tokens would admit ~90 of 256 and start the rest late (a queue, not a
    # tail). (--filter: the largest of a round, and the bound on what refills can add to the first
    # launch)
    launched = (
        max(len(drawn), args.round_prompts, args.launch_prompts, 4 * args.prompts)
        if args.filter
        else len(drawn)
    )
    cfg.rollout.max_total_tokens = (
        launched * args.group_size * (max(map(len, drawn)) + args.max_new_tokens)
    )
    print(
        f"{args.prompts} prompts x {args.group_size}, policy={args.policy} "
        f"drop_rate={args.drop_rate} over_sample_rate={args.over_sample_rate}: "
        f"launch {plan.num_prompts} prompts, "
        f"stop at {plan.target_samples} samples ({plan.target_groups} groups for 'group')"
    )

    engine = RolloutEngine(model_dir, cfg.rollout, dtype=cfg.model.engine_dtype, seed=args.seed)
    # both: one engine serves the two in turn (the suite's smoke run)
    if args.partial or args.filter:
        try:
            for mode, on in ((multi_step, args.partial), (filtering, args.filter)):
                if on:
                    mode(engine, policy, tokenizer, cfg, plan, args)
            return
        finally:
            engine.shutdown()
            shutil.rmtree(out_dir)
    try:
        # warm-up: first-call costs, not measured
        samples, _, _ = run_arm(engine, base_prompts, args, None)
        lengths = sorted(len(s.response_ids) for s in samples)
        print(
            f"warm-up response lengths: median {lengths[len(lengths) // 2]}, "
            f"p80 {lengths[int(0.8 * len(lengths))]}, max {lengths[-1]}"
        )
        base_s = []
        cancel_s = []
        ideals = []
        latencies_ms = []
        wasted = []
        for repeat in range(args.repeats):
            # alternate the arms so drift in the machine's load hits both alike
            samples, stats, _ = run_arm(engine, base_prompts, args, None)
            base_s.append(stats.rollout_s)
            ideals.append(ideal_speedup(samples, plan))
            _, stats, tokens = run_arm(engine, cancel_prompts, args, plan)
            cancel_s.append(stats.rollout_s)
            latencies_ms.append(stats.cancel_latency_s * 1e3)
            wasted.append(tokens)
            print(
                f"repeat {repeat}: baseline {base_s[-1]:.3f} s (ideal {ideals[-1]:.2f}x), cancel "
                f"{cancel_s[-1]:.3f} s (decided at {stats.decision_s:.3f} s, "
                f"{stats.num_cancelled} cancelled, {tokens} wasted tokens, "
                f"cancel latency {latencies_ms[-1]:.1f} ms), "
                f"speedup {base_s[-1] / cancel_s[-1]:.2f}x"
            )
    finally:
        engine.shutdown()
        shutil.rmtree(out_dir)  # the exported model; the engine no longer reads it

    baseline = statistics.median(base_s)
    cancel = statistics.median(cancel_s)
    ideal = statistics.median(ideals)
    speedup = baseline / cancel
    print(
        f"tail: baseline_s={baseline:.3f} cancel_s={cancel:.3f} speedup={speedup:.3f} "
        f"ideal={ideal:.3f} efficiency={speedup / ideal:.3f} "
        f"cancel_latency_ms={statistics.median(latencies_ms):.1f} "
        f"wasted_tokens={round(statistics.median(wasted))}"
    )


def multi_step(engine, policy, tokenizer, cfg, plan, args):
    """`--repeats` runs of `--steps` rollouts per arm on fresh prompts each step, the three arms
    alternated inside every step in a rotating order (none always runs first after the weight
    sync). Each repeat starts an empty partial-rollout buffer on prompts of its own; its step 0
    fills it and warms up, not measured. Useful tokens: response tokens of the samples that step
    trains (baseline: all; drop: the finished; partial: the groups that completed, tokens from
    earlier steps included). Wasted: generated, then thrown away (drop: every cancelled sample;
    partial: restarts for staleness). Partial's buffer at the end still holds tokens not yet
    trained: counted as neither (this only lowers its useful tokens/s). The last line gives the
    medians over the repeats of each repeat's ratios: one noisy repeat cannot decide."""
    plan = dataclasses.replace(plan, partial=True)
    arms = {"baseline": None, "drop": dataclasses.replace(plan, partial=False), "partial": plan}
    vs_baseline = []
    vs_drop = []
    partial_wasted = []
    for repeat in range(args.repeats):
        buffer = PartialBuffer(args.group_size, args.max_staleness, args.max_new_tokens)
        seconds = {arm: [] for arm in arms}
        useful, wasted = dict.fromkeys(arms, 0), dict.fromkeys(arms, 0)
        for step in range(args.steps + 1):
            # a weight sync between steps (the same weights: rollouts are what is measured);
            # versions keep rising over the repeats, as in one long run
            version = repeat * (args.steps + 1) + step
            engine.update_weights(policy.named_parameters(), version=version)
            step_prompts = tiny.draw(
                tokenizer, plan.num_prompts, cfg.data.tiny_max_count, args.seed + 1000 * version
            )
            prompts = [p.prompt_ids for p in step_prompts]
            order = list(arms)[step % 3 :] + list(arms)[: step % 3]
            line = []
            for arm in order:
                arm_plan = arms[arm]
                engine.flush_cache()
                if arm == "partial":
                    stream = tasks.PromptStream(step_prompts, seed=0)  # what the buffer reads
                    resumes, new, held = buffer.launch(stream, plan.num_prompts, version)
                    launch = [p.prompt_ids for p in new]
                # over-sampling launches more prompts than the batch; the baseline launches just the
                # batch
                else:
                    resumes, launch = (), prompts if arm_plan else prompts[: args.prompts]
                samples, stats = engine.generate(
                    launch,
                    args.group_size,
                    args.temperature,
                    args.max_new_tokens,
                    arm_plan,
                    resumes=resumes,
                )
                assert engine.num_in_flight() == 0, "a rollout left requests in the engine"
                if arm == "partial":  # the buffer's counters are this step's (reset by `launch`)
                    complete = buffer.collect(samples, new + held)
                    trained = [turn for group in complete for turns in group for turn in turns]
                    lost = buffer.counters["wasted_tokens"]
                else:
                    trained = [s for s in samples if not s.masked]
                    lost = sum(len(s.response_ids) for s in samples if s.masked)
                tokens = sum(len(s.response_ids) for s in trained)
                line.append(f"{arm} {stats.rollout_s:.3f} s {tokens} useful {lost} wasted")
                if step > 0:
                    seconds[arm].append(stats.rollout_s)
                    useful[arm] += tokens
                    wasted[arm] += lost
            print(
                f"repeat {repeat} step {step}{' (warm-up)' if step == 0 else ''}: "
                + ", ".join(line)
            )
        rate = {arm: useful[arm] / sum(seconds[arm]) for arm in arms}
        for arm in arms:
            print(
                f"repeat {repeat} {arm}: median_step_s={statistics.median(seconds[arm]):.3f} "
                f"useful_tokens_per_s={rate[arm]:.1f} useful_tokens={useful[arm]} "
                f"wasted_tokens={wasted[arm]}"
            )
        in_buffer = sum(len(g.members[i][-1].response_ids) for g, i in buffer.waiting)
        print(
            f"repeat {repeat} partial: buffer at the end holds {len(buffer.waiting)} "
            f"unfinished samples ({in_buffer} tokens) and {len(buffer.groups)} groups; "
            f"max_staleness={args.max_staleness}"
        )
        vs_baseline.append(rate["partial"] / rate["baseline"])
        vs_drop.append(rate["partial"] / rate["drop"])
        partial_wasted.append(wasted["partial"])
    median = statistics.median
    print(
        f"partial: per repeat vs baseline {' '.join(f'{r:.3f}' for r in vs_baseline)}, vs drop "
        f"{' '.join(f'{r:.3f}' for r in vs_drop)}"
    )
    print(
        f"partial: speedup_vs_baseline={median(vs_baseline):.3f} "
        f"speedup_vs_drop={median(vs_drop):.3f} "
        f"wasted_tokens={round(median(partial_wasted))}"
    )


def filtering(engine, policy, tokenizer, cfg, plan, args):
    """Dynamic sampling: three ways to collect `--prompts` informative groups, on the same
    prompts (each repeat draws its own), the arms alternated in a rotating order. The reward
    makes about half the groups zero-variance: a prompt whose token ids sum to an even number is
    "easy" (every member gets 1), any other rewards a response by its length's parity (this
    model's lengths vary, so its group is informative but for a 2 x 0.5^8 chance). Arms:
    `rounds`, DAPO's recipe (verl-recipe dapo/): synchronous rounds of `--round-prompts` prompts
    (default 3x the batch, as the official script generates 3 x 512 for 512), each waited for
    whole, until enough kept groups (the surplus thrown away); `wait_all`, a streaming filter
    that drains (verl's V1): this trainer's launch and refills, groups judged as they finish, but
    everything launched is waited for; `abort`, this trainer: the same, then the rest aborted
    once the batch is in (rollout.filter_groups with cancel count). The streaming arms first
    launch `--launch-prompts` (default: a round's), so by default the three differ only in how
    they stop and refill. Each arm's rate: the batch's `--prompts` groups over the rollout
    seconds it took (medians of the repeats' ratios)."""

    def reward(prompts):
        def score(turns):
            easy = sum(prompts[turns[-1].group_id]) % 2 == 0
            return 1.0 if easy else float(len(turns[-1].response_ids) % 2)

        return score

    target = args.prompts
    filter_plan = dataclasses.replace(
        plan,
        filter_groups=True,
        target_groups=target,
        num_prompts=args.launch_prompts,
        refill_prompts=max(target // 4, 1),  # the config's default
        max_prompts=max(4 * target, args.launch_prompts),
    )
    arms = {
        "rounds": None,
        "wait_all": dataclasses.replace(filter_plan, cancel="none"),
        "abort": filter_plan,
    }
    vs_rounds = []
    vs_wait_all = []
    kept_groups = []
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        stream = [
            p.prompt_ids
            for p in tiny.draw(
                tokenizer,
                10 * max(target, args.round_prompts),
                cfg.data.tiny_max_count,
                args.seed + 1000 * repeat,
            )
        ]
        order = list(arms)[repeat % 3 :] + list(arms)[: repeat % 3]
        seconds = {}
        kept = {}
        line = []
        for arm in order:
            engine.flush_cache()
            prompts = list(stream[: filter_plan.num_prompts])

            def more_prompts(count, first_group_id):
                # group ids index `prompts`: the next ones are first_group_id, ...
                prompts.extend(stream[len(prompts) : len(prompts) + count])
                return prompts[first_group_id:]

            if arm == "rounds":
                kept[arm] = 0
                seconds[arm] = 0.0
                rounds = 0
                while kept[arm] < target:
                    batch = stream[rounds * args.round_prompts : (rounds + 1) * args.round_prompts]
                    samples, stats = engine.generate(
                        batch,
                        args.group_size,
                        args.temperature,
                        args.max_new_tokens,
                        reward=reward(batch),
                    )
                    kept[arm] += informative_groups(
                        sample.groups_of(sample.trajectories_of(samples))
                    )[1]["kept_groups"]
                    seconds[arm] += stats.rollout_s
                    rounds += 1
                line.append(f"rounds {seconds[arm]:.3f} s ({rounds} rounds, {kept[arm]} kept)")
            else:
                samples, stats = engine.generate(
                    prompts,
                    args.group_size,
                    args.temperature,
                    args.max_new_tokens,
                    arms[arm],
                    reward=reward(prompts),
                    more_prompts=more_prompts,
                )
                counts = informative_groups(sample.groups_of(sample.trajectories_of(samples)))[1]
                seconds[arm], kept[arm] = stats.rollout_s, counts["kept_groups"]
                line.append(
                    f"{arm} {stats.rollout_s:.3f} s ({stats.prompts_launched} prompts, "
                    f"{counts['kept_groups']} kept, "
                    f"{counts['zero_variance_groups']} zero-variance, "
                    f"{stats.num_cancelled} cancelled)"
                )
            assert engine.num_in_flight() == 0, "a rollout left requests in the engine"
        print(f"repeat {repeat}{' (warm-up)' if repeat == 0 else ''}: " + ", ".join(line))
        # kept groups per rollout second, a surplus over the batch thrown away (it is not trained)
        if repeat > 0:
            rate = {arm: min(kept[arm], target) / seconds[arm] for arm in arms}
            vs_rounds.append(rate["abort"] / rate["rounds"])
            vs_wait_all.append(rate["abort"] / rate["wait_all"])
            kept_groups.append(min(kept["abort"], target))
    median = statistics.median
    print(
        f"filter: per repeat vs rounds {' '.join(f'{r:.3f}' for r in vs_rounds)}, vs wait_all "
        f"{' '.join(f'{r:.3f}' for r in vs_wait_all)}"
    )
    print(
        f"filter: speedup_vs_rounds={median(vs_rounds):.3f} "
        f"speedup_vs_wait_all={median(vs_wait_all):.3f} "
        f"kept_groups={min(kept_groups)}"
    )


if __name__ == "__main__":
    main()
