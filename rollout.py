"""Stage 1 of the step: the rollout, with rewards.

`collect` is the stage: it asks the data stream (and partial rollout's buffer) what to launch,
samples group_size trajectories per prompt on the engine (single- or multi-turn with a tool, or
continuing suspended samples), each scored by the reward step as it finishes, cancels the tail as
cancel.py's policy decides, then applies dynamic sampling's filter and returns the stage's
metrics. `RolloutEngine.generate` is the stage's one call into the engine; the rollout in flight
(one asyncio task per trajectory, waiting for enough, refills, the abort inside the engine) is
inflight.py. `validate` is the loop's validation rollout. Does not own the stop rules (cancel.py),
how text becomes a reward (rewards.py), which samples are suspended (partial.py), the engine's
API (runtime/engine.py), or the loss.
"""

from cancel import GroupFilter, informative_groups, plan_launch
from config import max_trajectory_tokens
from inflight import Request, Rollout, Settings, check_launch
from metrics import length_stats, pass_at_k, rate, ratio, slowest, spread, summed, trajectory_texts
import runtime.parallel as parallel
from runtime.engine import Engine
import runtime.seeds as seeds
from sample import groups_of, trajectories_of


# ---------------------------------------------------------------- stage 1: the training rollout
def collect(run, step):
    """This rank's training rollout for `step`: (GRPO groups, each a list of trajectories, each a
    list of scored turns; the stage's metrics). Over-sampling, the cancel policy, dynamic sampling
    and partial rollout are `rollout.*` settings, switched inside (the step never sees a buffer or
    a refill). Partial rollout: earlier steps' unfinished samples go first and only complete
    groups come back (partial.py). Dynamic sampling: the engine asks for more prompts as it goes
    (`refills`), and only groups whose rewards differ come back (`cancel.informative_groups`).
    """
    r = run.cfg.rollout
    # what to launch and when to stop waiting (cancel.py); with rollout.cancel none, the default:
    # this rank's share of prompts_per_step, group_size requests each, every one awaited
    plan = plan_launch(r, r.prompts_per_step // parallel.world_size(), run.cfg.train.mask_truncated)
    buffer = run.buffer  # partial rollout's suspended samples (partial.py); None when off
    resumes = []
    held_prompts = []
    held_survivors = None
    if buffer is None:
        new_prompts = run.stream.take(plan.num_prompts)
    else:
        version = run.engine.weight_version
        resumes, new_prompts, held_prompts = buffer.launch(run.stream, plan.num_prompts, version)
        held_survivors = buffer.held_survivors()
    # indexed by group id: the new prompts' (0..), the held groups', then refills' (partial.py)
    prompts_by_group = new_prompts + held_prompts
    samples, stats = run.engine.generate(
        [p.prompt_ids for p in new_prompts],
        r.group_size,
        r.temperature,
        r.max_new_tokens,
        plan,
        tool=run.tool,
        max_turns=r.max_turns,
        max_response_tokens=r.max_response_tokens,
        resumes=resumes,
        reward=run.rewards.for_rollout(prompts_by_group),
        more_prompts=refills(run.stream, prompts_by_group) if r.filter_groups else None,
        held_survivors=held_survivors,
        seed=rollout_seed(run.cfg.train.seed, step),
    )
    if buffer is None:
        groups = groups_of(trajectories_of(samples))
    else:
        groups = buffer.collect(samples, prompts_by_group)
    metrics = rollout_metrics([turns for group in groups for turns in group], stats)
    if buffer is not None:
        metrics |= buffer.metrics()  # its rollout/* counts replace rollout_metrics'
    # dynamic sampling keeps the groups whose rewards differ (off: all kept, the counts logged)
    groups, counts = informative_groups(groups, r.filter_groups, run.cfg.train.mask_truncated)
    trained = [turns for group in groups for turns in group]
    metrics |= filter_metrics(
        trained, counts, stats, plan.target_groups, r.filter_groups, run.cfg.train.mask_truncated
    )
    return groups, metrics


def refills(stream, prompts_by_group):
    """Dynamic sampling's source of more prompts (`more_prompts(count, first_group_id)`): this
    rank's `stream`, each refill appended to `prompts_by_group`, numbered on after every group id
    so far."""

    def more_prompts(count, first_group_id):
        assert first_group_id == len(prompts_by_group)
        prompts_by_group.extend(stream.take(count))
        return [p.prompt_ids for p in prompts_by_group[first_group_id:]]

    return more_prompts


def rollout_seed(run_seed, step, purpose="train"):
    """The seed of one rollout, from which each request's sampling_seed derives (`request_seed`):
    the same run seed samples the same tokens wherever the engine's arithmetic allows
    (rollout.deterministic)."""
    return seeds.derive(run_seed, "rollout", step, purpose)


class RolloutEngine(Engine):
    """The engine, generating the trainer's rollouts (one `Rollout` per call of `generate`)."""

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts,
        group_size,
        temperature,
        max_new_tokens,
        plan=None,
        *,
        tool=None,
        max_turns=1,
        max_response_tokens=0,
        resumes=(),
        reward=None,
        more_prompts=None,
        held_survivors=None,
        seed=None,
    ):
        """Sample `group_size` trajectories per prompt; with a `plan`, cancel the tail as
        cancel.decide says. With `seed`, every request carries its own sampling_seed
        (`request_seed`).

        prompts: list of token-id lists. A trajectory is one turn, or with a `tool` run on a turn
        ending in `tool.call_end_id`, up to `max_turns` turns within `max_response_tokens` generated
        + observation tokens. `resumes` (partial rollout, single-turn only): unfinished samples
        launched first, each continued from its prompt + partial response with what is left of the
        budget; the caller gives them group ids after the new prompts' (0..), one per held group.
        `reward` (turns -> float) scores each finished trajectory as it returns, every turn getting
        the value. With `plan.filter_groups` (dynamic sampling), `more_prompts(count,
        first_group_id=)` supplies more prompts (token-id lists), and `held_survivors` ({group id:
        last turns}) are a held group's members that finished before, with their rewards.

        Returns (every turn of every trajectory in launch order: resumes first, refills last, each
        turn's `trajectory_id` its request's launch index; RolloutStats).
        """
        sampling = {
            "temperature": temperature,
            "top_p": self.cfg.top_p if temperature > 0 else 1.0,
            "max_new_tokens": max_new_tokens,
        }
        if tool is not None:
            # pause generation at the end of a tool call
            sampling["stop_token_ids"] = [tool.call_end_id]
        settings = Settings(
            sampling=sampling,
            group_size=group_size,
            budget=max_trajectory_tokens(max_new_tokens, max_turns, max_response_tokens),
            max_turns=max_turns,
            tool=tool,
            reward=reward,
            plan=plan,
            more_prompts=more_prompts,
            # a training rollout's bound only: validation and eval wait for every request (a
            # cut answer would score 0 in their means; request_timeout_s bounds a hung one)
            timeout_s=self.cfg.rollout_timeout_s if plan is not None else 0.0,
            seed=seed,
            held={group_id: len(s) for group_id, s in (held_survivors or {}).items()},
        )
        requests = [Request(i, s.group_id, s.prompt_ids, resumed=s) for i, s in enumerate(resumes)]
        for group_id, ids in enumerate(prompts):
            for _ in range(group_size):
                requests.append(Request(len(requests), group_id, ids))
        check_launch(requests, settings, self.cfg.max_total_tokens)
        filtering = plan is not None and plan.filter_groups
        whole = group_size if filtering and plan.cancel == "group" else 0
        group_filter = (
            GroupFilter(held_survivors, whole, plan.mask_truncated) if filtering else None
        )
        rollout = Rollout(self, settings, group_filter)
        return self._run(rollout.run(requests))


# ---------------------------------------------------------------- the loop's validation
def generate_scored(run, prompts, group_size, temperature, seed=None):
    """Validation's rollout (and the tests'; eval has its own): `group_size` trajectories per
    prompt, every request waited for, each scored by the task's reward. Returns (samples,
    RolloutStats)."""
    r = run.cfg.rollout
    return run.engine.generate(
        [p.prompt_ids for p in prompts],
        group_size,
        temperature,
        r.max_new_tokens,
        tool=run.tool,
        max_turns=r.max_turns,
        max_response_tokens=r.max_response_tokens,
        reward=run.rewards.for_rollout(prompts),
        seed=seed,
    )


def validate(run, version):
    """Greedy and sampled (training temperature) reward of weight `version`: greedy decoding hides
    policy changes that sampling shows, and sampling is what the next rollout sees. Never
    cancelled. Each rank scores its share of the prompts; sums and counts are reduced, so the
    means are exact. Returns (scalars, texts): rank 0's first greedy trajectories as text."""
    out = {}
    texts = {}
    prompts = parallel.rank_share(run.val_prompts)
    n = run.cfg.run.val_samples
    for suffix, temperature, group_size in (
        ("", 0.0, 1),
        ("_sampled", run.cfg.rollout.temperature, n),
    ):
        seed = rollout_seed(run.cfg.train.seed, version, f"val{suffix}")
        samples = generate_scored(run, prompts, group_size, temperature, seed)[0] if prompts else []
        trajectories = trajectories_of(samples)  # scored as they finished
        if not suffix and parallel.rank() == 0 and run.cfg.run.log_samples:
            texts["val/samples"] = trajectory_texts(
                trajectories, run.tokenizer, run.cfg.run.log_samples
            )
        scores = [turns[-1].reward for turns in trajectories]
        # trajectories with at least one well-formed tool call
        called = sum(any(t.tool_call == 1 for t in turns) for turns in trajectories)
        total, correct, calls, count = parallel.all_reduce(
            [sum(scores), sum(r >= 1.0 for r in scores), called, len(scores)]
        )
        out[f"val/reward_mean{suffix}"] = total / count
        out[f"val/accuracy{suffix}"] = correct / count
        if group_size > 1:
            out |= pass_at_ks(trajectories, group_size)
        if run.tool is not None:
            out[f"val/tool_call_ratio{suffix}"] = calls / count
    return out, texts


def pass_at_ks(trajectories, n):
    """val/pass@k for k = 1, 2, 4, ... up to n (extras/eval.py's estimator), from n scored
    trajectories per prompt (group ids: the prompts), exact over ranks."""
    correct = {}
    for turns in trajectories:
        group = turns[-1].group_id
        correct[group] = correct.get(group, 0) + (turns[-1].reward >= 1.0)
    ks = [2**i for i in range(n.bit_length()) if 2**i < n] + [n]
    sums = [sum(pass_at_k(n, c, k) for c in correct.values()) for k in ks]
    *sums, count = parallel.all_reduce(sums + [len(correct)])
    return {f"val/pass@{k}": total / count for k, total in zip(ks, sums)}


# ---------------------------------------------------------------- the stage's metrics
def rollout_metrics(trajectories, stats):
    """Reward, length, cancellation and tool statistics of one training rollout (`stats`:
    RolloutStats).

    Counted per trajectory (its last turn; a single-turn sample is its own trajectory). Aborted and
    failed trajectories are not scored: `reward_mean_completed` averages finished ones (a dropped
    group's finished members too), `reward_mean_launched` counts unfinished ones as 0, so the
    survivor bias of tail cancellation (verl PR 2929) is visible as the gap between the two, never
    negative with rewards >= 0. Token counts cover every turn: a response's length is what the model
    wrote over its trajectory's turns (tool observations apart: rollout.max_response_tokens counts
    them too, so a cut trajectory logs less). `wasted_tokens`: what cancellation threw away, the cut
    trajectories' and the dropped groups' (not failures').
    """
    samples = [turn for turns in trajectories for turn in turns]
    launched = [turns[-1] for turns in trajectories]  # the last turn of each trajectory
    finished = [s for s in launched if not s.masked]
    # finished samples of groups a cancel policy's keep_groups left out (cancel.drop_other_groups)
    dropped = [turns for turns in trajectories if turns[-1].finish_reason == "dropped"]
    # the trajectories cut by cancellation: masked, neither failed nor dropped
    failed = ("error", "reward_error", "dropped")
    aborted = [t for t in trajectories if t[-1].masked and t[-1].finish_reason not in failed]
    # every finished trajectory's reward: a cancel policy's dropped groups (masked, not trained)
    # and dynamic sampling's filtered ones too (its train/ figures are the kept ones':
    # filter_metrics)
    reward_sum = sum(s.reward for s in finished) + sum(turns[-1].reward for turns in dropped)
    out = {
        "rollout/reward_mean_completed": ratio(reward_sum, len(finished) + len(dropped)),
        "rollout/reward_mean_launched": ratio(reward_sum, len(launched)),
        "rollout/launched": summed(len(launched)),
        "rollout/aborted": summed(len(aborted)),
        "rollout/aborted_ratio": ratio(len(aborted), len(launched)),
        # this rollout's engine failures (inflight.check_failures): with partial rollout the
        # trajectories here are the complete groups', whose failures may be older
        "rollout/failed": summed(stats.num_failed),
        "rollout/dropped": summed(len(dropped)),
        # over every finished trajectory, the dropped ones' too (cut: counted as they were dropped)
        "rollout/truncated_ratio": ratio(
            sum(s.finish_reason == "length" for s in finished) + stats.num_dropped_truncated,
            len(finished) + len(dropped),
        ),
        "rollout/wasted_tokens": summed(
            sum(len(t.response_ids) for turns in aborted + dropped for t in turns)
        ),
        # what the engine generated in this rollout: with partial rollout the trajectories here
        # are the complete groups', which hold earlier steps' tokens and not this step's suspended
        "perf/rollout_tokens_per_s": rate(stats.generated_tokens, stats.rollout_s),
        "timing/rollout_s": slowest(stats.rollout_s),
        "rollout/cancel_decision_s": slowest(stats.decision_s),  # launch -> enough finished
        # decision -> every aborted request returned
        "rollout/cancel_latency_s": slowest(stats.cancel_latency_s),
        "rollout/tool_calls": summed(stats.num_tool_calls),
        "rollout/tool_errors": summed(stats.num_tool_errors),
        **{f"tools/{name}/calls": summed(n) for name, n in stats.tool_calls.items()},
        **{f"tools/{name}/errors": summed(n) for name, n in stats.tool_errors.items()},
        "rollout/tool_calls_per_trajectory": ratio(stats.num_tool_calls, len(launched)),
        "rollout/turns_per_trajectory": ratio(len(samples), len(launched)),
        "rollout/timed_out": summed(stats.num_timed_out),
        "rollout/reward_errors": summed(stats.num_reward_errors),
    }
    # every finished trajectory's length, the dropped ones' too: the groups dropped are the last
    # to finish, often the longest
    done = [t for t in trajectories if not t[-1].masked or t[-1].finish_reason == "dropped"]
    lengths = [sum(len(t.response_ids) for t in turns) for turns in done]
    out.update(length_stats(lengths, "rollout/response_len"))
    if aborted:
        cut = [sum(len(t.response_ids) for t in turns) for turns in aborted]
        out.update(length_stats(cut, "rollout/aborted_len"))
    return out


def filter_metrics(trajectories, counts, stats, target_groups, filtering, mask_truncated=False):
    """Dynamic sampling's figures (logged with it off too: the zero-variance share says what it
    would save), and the reward statistics of `trajectories`, the trained ones (`counts`:
    cancel.informative_groups'): `train/reward_mean`, `train/accuracy` and `train/reward_std` are
    what was trained on (with `mask_truncated`, train.mask_truncated, not the members cut at the
    budget: merge.training_sequences drops them), `rollout/reward_mean_completed`
    (rollout_metrics) every finished trajectory (NeMo-RL issue 3794: a filter whose logged reward
    was silently the unfiltered one)."""
    rewards = [
        turns[-1].reward
        for turns in trajectories
        if not (turns[-1].masked or turns[-1].overlong_filtered(mask_truncated))
    ]
    return {
        **{f"filter/{name}": summed(value) for name, value in counts.items()},
        "filter/prompts_launched": summed(stats.prompts_launched),
        # 1 when filtering kept fewer groups than the target (the prompt bound ended the step),
        # on any rank (`slowest`: reduced by max)
        "filter/truncated_steps": slowest(filtering and counts["kept_groups"] < target_groups),
        "train/reward_mean": ratio(sum(rewards), len(rewards)),
        "train/accuracy": ratio(sum(r >= 1.0 for r in rewards), len(rewards)),
        "train/reward_std": spread(rewards),
        "perf/generated_tokens_per_kept_group": ratio(
            stats.generated_tokens, counts["kept_groups"]
        ),
    }
