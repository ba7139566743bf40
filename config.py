"""The one Config dataclass tree, and loading it from YAML plus `--set section.key=value` overrides.

Owns every setting's name, type, default, one-line meaning and numeric bounds; YAML files in
configs/ only override. An unknown key, a value of the wrong type or out of bounds is a ConfigError
that names it. Does not own the choices a field picks from (a cancel policy, an advantage
estimator, a loss mode): each is a dict or tuple in the module that reads it, checked there by its
`check(cfg)` at load (assemble.py's load_config calls `read_config`, then them all). Imports
nothing of the project.
"""

import dataclasses
import difflib
import importlib
import importlib.util
import json
import math
import os
import re
import reprlib
import shlex
import sys
import sysconfig
import traceback
import types
import typing
from typing import Annotated

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a number field admits, written beside it: `lr: Annotated[float, Range(gt=0)]`
    (pydantic's spelling, without pydantic: its errors run to several lines and it would be
    one more library to read for 30 lines of checks). A float must also be finite whatever its
    bounds: NaN or inf would train 2-3 steps, then stop on a non-finite loss."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    why: str = ""  # said in the error where the bound is not self-evident

    def admits(self, value):
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def __str__(self):
        bounds = {">": self.gt, ">=": self.ge, "<": self.lt, "<=": self.le}
        said = [f"{op} {bound}" for op, bound in bounds.items() if bound is not None]
        return " and ".join(said)


PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]  # 0 is "off" or "the engine decides" (see the field)
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]


def shown(value, limit=100):
    """`value`'s repr for an error message, cut to `limit` characters: a few lines of YAML
    anchors can expand to gigabytes (a "billion laughs"), and an error stays one readable line."""
    short = reprlib.Repr()  # it stops descending at maxlevel, so a nested bomb costs nothing
    short.maxlevel = 2
    short.maxlist = 4
    short.maxdict = 4
    short.maxstring = limit
    text = short.repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass
class ModelConfig:
    path: str = "tiny"  # "tiny" builds the demo model locally; else a HF folder or hub id
    # Parameters, gradients and AdamW state are always float32 (master weights): at lr 1e-6 an AdamW
    # update is below bfloat16's spacing for almost every weight and would round away. These two say
    # what runs in:
    # trainer forward/backward: float32 | bfloat16 (autocast, or FSDP2 mixed precision)
    compute_dtype: str = "float32"
    # the rollout engine's weights, cast from the masters at every weight sync
    engine_dtype: str = "float32"
    # with bfloat16 (either dtype): the output head's logits summed and kept in float32 in the
    # trainer and the engine (loss.head_logits; SGLang's enable_lm_head_fp32), not rounded to
    # bfloat16 (1/8 apart at logits of 16-32: noise in a later minibatch's ratio and the KL)
    fp32_head: bool = False
    # the trainer's attention: sdpa | flex_attention (GPU only; see model.ATTENTION)
    attn_implementation: str = "sdpa"
    # run Python code shipped in a model folder (trainer and engine): only if you trust it
    trust_remote_code: bool = False
    hidden_size: PositiveInt = 64  # tiny model only, from here on
    intermediate_size: PositiveInt = 256
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    max_position_embeddings: Annotated[int, Range(ge=2)] = 256
    # LoRA (runtime/lora.py): > 0 trains rank-r adapters on a frozen base instead of every weight
    # (FSDP2 shards them with several ranks); the others are read only then
    lora_rank: NonNegativeInt = 0
    # the adapters' update is scaled by lora_alpha / lora_rank
    lora_alpha: Annotated[
        float, Range(gt=0, le=1e6, why="a scale past float32's range makes B = 0 give NaN")
    ] = 16.0
    # parameters trained in full beside the adapters, by a part of their name (peft's
    # modules_to_save): ["norm"] trains every RMSNorm's weight, which a random base needs to sharpen
    # its logits (configs/tiny_lora.yaml)
    lora_also_train: list[str] = dataclasses.field(default_factory=list)
    # the linear layers given adapters, by the last part of their name (default: every projection
    # of a decoder layer, as "LoRA without regret" finds attention-only adapters learn worse in RL)
    lora_targets: list[str] = dataclasses.field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )


@dataclasses.dataclass
class DataConfig:
    # a task module of task/, found by name (task/data.py): built in, tiny | tiny_tool (multi-turn
    # calculator demo) | gsm8k | chat (your own rows and reward) | reverse (a task module's
    # example); or any module added there
    task: str = "tiny"
    train_path: str = ""  # gsm8k, chat: a .jsonl / .parquet file or a hub name such as openai/gsm8k
    val_path: str = ""  # default: train_path's "test" split (a file: the same rows)
    # chat: a row's prompt, a string (one user message) or a list of chat messages
    prompt_field: str = "prompt"
    # chat: what the reward compares against (a string or a number; the reward gets it as text)
    answer_field: str = "answer"
    # chat (gsm8k: optional): "path/to/file.py:function" or "module:function", see README
    reward: str = ""
    hub_subset: str = ""  # a hub dataset's configuration name (gsm8k: "main")
    # gsm8k, chat: variables the tokenizer's chat template reads beyond the messages, such as
    # {enable_thinking: false} for Qwen3's (transformers hands them to the template)
    chat_template_kwargs: dict[str, bool | int | float | str] = dataclasses.field(
        default_factory=dict
    )
    max_prompt_len: PositiveInt = 512  # longer prompts are counted and skipped (every task)
    # tiny task: N is drawn from 1..tiny_max_count with weight 1/N
    tiny_max_count: Annotated[
        int, Range(ge=1, le=100_000, why="the task weighs every N: a longer list only stalls")
    ] = 32
    # tiny_tool task: prompts "a*b-c=" with a, b of this many digits (1..7)
    tiny_operand_digits: Annotated[
        int, Range(ge=1, le=7, why="the calculator is exact below 1e15")
    ] = 2
    num_tiny_prompts: PositiveInt = 4096  # tiny tasks: size of the drawn training set
    num_val_prompts: PositiveInt = 64  # validation prompts used (all if fewer)


@dataclasses.dataclass
class RolloutConfig:
    # prompts a step trains on, over all ranks (each rank takes its share: a multiple of run.nproc)
    prompts_per_step: PositiveInt = 32
    # samples per prompt (GRPO group)
    group_size: Annotated[int, Range(ge=2, why="GRPO compares samples within a group")] = 8
    # training samples (validation's greedy pass is apart): the trainer divides its logits by it,
    # and below 0.01 they overflow (0 divides by zero)
    temperature: Annotated[float, Range(ge=0.01, why="the trainer divides its logits by it")] = 1.0
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    max_new_tokens: PositiveInt = 48  # per turn
    max_turns: PositiveInt = 1  # > 1: multi-turn, the model calling tools between turns
    # gsm8k, chat with max_turns > 1: the tools the model may call, each "path/to/file.py:function"
    # or "module:function", a plain (or async) Python function with type hints and a docstring
    # (task/tools.py; README "Your own tools"). None given: the built-in calculator. (tiny_tool: its
    # own "?" calculator only)
    tools: list[str] = dataclasses.field(default_factory=list)
    # a tool still running after this many seconds answers with an error observation (timed from
    # its start: a call queued for a thread waits while threads come free, and gives up after
    # this long with none coming free)
    tool_timeout_s: PositiveFloat = 10.0
    # a tool's result or error message longer than this is cut, with a visible marker: it shares
    # the trajectory's token budget (a tool raising a 100 KB message would fill it)
    max_observation_chars: PositiveInt = 2000
    # threads running plain tool functions, apart from the rewards' (a call past its limit or
    # cancelled has its thread replaced, up to tool_workers at a time: runtime/threads.py; daemon
    # threads: one that never returns cannot keep the process from exiting)
    tool_workers: PositiveInt = 4
    # per trajectory: generated + observation tokens (0 = max_new_tokens x max_turns)
    max_response_tokens: NonNegativeInt = 0
    # train prefix-sharing turns as one sequence (merge.py) instead of one per turn (unmerged:
    # train.loss_agg token-mean only, since the other modes average over sequences: merge.check)
    merge_turns: bool = True
    # SGLang's deterministic inference (GPU only: it needs the fa3, flashinfer or triton attention
    # backend; sglang/srt/arg_groups/overrides.py rejects the CPU's torch_native). Only then does
    # the engine use each request's sampling_seed (inflight.request_seed), which the trainer always
    # sends (sglang/srt/sampling/sampling_batch_info.py)
    deterministic: bool = False
    # threads running plain reward functions off the rollout's event loop (rewards.py); an async
    # def reward is awaited on the loop instead
    reward_workers: PositiveInt = 4
    # a reward still running after this many seconds fails its trajectory (counted in
    # rollout/reward_errors); 0 = no limit. A thread cannot be stopped: a reward past its limit
    # has its worker replaced, up to reward_workers at a time (runtime/threads.py), so give a
    # judge or sandbox its own timeout
    reward_timeout_s: NonNegativeFloat = 60.0
    # OMP threads of each engine process: on 2 cores, 1 is ~70x faster than OMP's default (a
    # thread per core: the engine's processes oversubscribe the cores)
    engine_threads: PositiveInt = 1
    # GPU: share of memory for engine weights + KV cache
    mem_fraction_static: Annotated[float, Range(gt=0, lt=1)] = 0.6
    # KV cache capacity in tokens, on GPU too (0 = engine decides from memory: the GPU configs)
    max_total_tokens: NonNegativeInt = 16384
    # tail cancellation: none | count | time | group, or a policy added to cancel.POLICIES
    cancel: str = "none"
    # any policy but none, without dynamic sampling: launch the batch, stop once (1 - drop_rate)
    # of it finished
    drop_rate: Annotated[float, Range(ge=0, lt=1)] = 0.0
    # any policy but none: launch (1 + rate) x the batch, stop once the batch finished; dynamic
    # sampling: launch (1 + rate) x its prompts first (its kept groups decide the stop)
    over_sample_rate: Annotated[
        float, Range(ge=0, le=10, why="each launches (1 + rate) x the batch")
    ] = 0.0
    # time: once this fraction of the target finished at t ...
    time_quantile: Annotated[float, Range(gt=0, le=1)] = 0.8
    time_factor: PositiveFloat = 1.5  # ... wait at most factor * t more, then cancel the rest
    # partial rollout (partial.py): a cancelled sample is suspended, not dropped, and continued in
    # the next step under the new weights; its group is trained once every member finished
    partial: bool = False
    # weight versions a resumed sample's oldest token may lag; older restarts from its prompt, once
    # (too old again: given up, its group trained on the members that finished); 0 = plain drop
    max_staleness: NonNegativeInt = 4
    # dynamic sampling (DAPO): train only groups whose rewards differ, judged as each group's last
    # member finishes; the rollout ends once prompts_per_step such groups finished, whatever
    # `cancel` (which then says whether the rest is aborted, or with none waited for), and launches
    # more prompts while too few can be kept
    filter_groups: bool = False
    # prompts launched at a time while too few groups can be kept (0 = prompts_per_step / 4)
    refill_prompts: NonNegativeInt = 0
    # new prompts a step may launch (0 = 4 x prompts_per_step); then it trains fewer groups
    max_prompts_per_step: NonNegativeInt = 0
    # a rollout where more of the requests fail inside the engine, or more of the rewards fail
    # (raise, time out, return a non-number), ends the run (RolloutError, RewardError), saved on
    # one rank (with several, the last periodic checkpoint stands)
    max_failed_ratio: Annotated[float, Range(ge=0, le=1)] = 0.1
    abort_timeout_s: PositiveFloat = 10.0  # aborted requests must return by then, or it is an error
    # a request running longer is aborted and counts as failed (0 = no limit)
    request_timeout_s: NonNegativeFloat = 0.0
    # a training rollout running longer aborts what is left, as a cancellation (0 = no limit);
    # validation and eval wait for every request
    rollout_timeout_s: NonNegativeFloat = 0.0

    def max_trajectory_tokens(self):
        """Tokens one trajectory may hold after its prompt: `max_trajectory_tokens` of this
        section."""
        return max_trajectory_tokens(self.max_new_tokens, self.max_turns, self.max_response_tokens)

    def resumes(self):
        """Whether partial rollout is on, so that tokens older weights sampled reach an update:
        `partial` with `max_staleness` > 0 (0 restarts every cancelled sample: plain dropping)."""
        return self.partial and self.max_staleness > 0


def max_trajectory_tokens(max_new_tokens, max_turns, max_response_tokens=0):
    """Tokens one trajectory may hold after its prompt (generated + tool observations): the one
    formula every reader of the budget uses (the rollout, DAPO's overlong penalty, Dr. GRPO's
    constant). With tools, max_response_tokens (0: max_new_tokens x max_turns) bounds the whole
    trajectory, observations included, so it may exceed max_new_tokens x max_turns; one turn
    never holds more than max_new_tokens."""
    if max_turns == 1:
        return min(max_new_tokens, max_response_tokens or max_new_tokens)
    return max_response_tokens or max_new_tokens * max_turns


@dataclasses.dataclass
class MemoryConfig:
    # staged | all_at_once | off (never release: engine and trainer both stay resident)
    mode: str = "staged"
    bucket_mb: PositiveInt = 256  # weight sync pushes parameters in buckets of about this size


@dataclasses.dataclass
class TrainConfig:
    steps: NonNegativeInt = 100
    lr: PositiveFloat = 5e-4
    adam_beta1: Annotated[float, Range(ge=0, lt=1)] = 0.9
    adam_beta2: Annotated[float, Range(ge=0, lt=1)] = 0.99
    # AdamW's, on every trained parameter: norms, biases and embeddings too (as verl; HF's Trainer
    # spares biases and norms)
    weight_decay: NonNegativeFloat = 0.0
    # linear learning-rate warmup over this many steps (all their minibatches), then the schedule
    warmup_steps: NonNegativeInt = 0
    # constant | cosine (decays to min_lr_ratio x lr at the last step)
    lr_schedule: str = "constant"
    # cosine: the final learning rate as a fraction of lr
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.1
    grad_clip: PositiveFloat = 1.0
    clip_eps: PositiveFloat = 0.2  # PPO ratio clip: [1 - clip_eps, 1 + clip_eps_high]
    # 0 = clip_eps; DAPO's clip-higher uses 0.28 with clip_eps 0.2
    clip_eps_high: NonNegativeFloat = 0.0
    # token | sequence (GSPO: one ratio per sequence; needs loss_agg seq-mean-token-mean) | cispo
    # (CISPO: a clipped, stop-gradient weight on every token's log-prob; needs token-mean)
    ratio_level: str = "token"
    # GSPO's clip range, used instead of clip_eps with ratio_level=sequence
    sequence_clip_eps: PositiveFloat = 3.0e-4
    sequence_clip_eps_high: PositiveFloat = 4.0e-4
    # CISPO's weight range [1 - low, 1 + high] with ratio_level=cispo. MiniMax-M1 bounds only the
    # top and publishes no value: low 1.0 (no lower bound) and high 2.0 are a start, not tuned
    cispo_eps_low: NonNegativeFloat = 1.0
    cispo_eps_high: NonNegativeFloat = 2.0
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg: str = "token-mean"
    # DAPO's overlong filtering: responses cut at the token budget stay out of the loss
    mask_truncated: bool = False
    # DAPO's soft overlong punishment, added to the reward the advantage reads (not to the logged
    # reward, accuracy or dynamic sampling's: advantages.overlong_penalty): from overlong_buffer
    # tokens before the generation budget, down to -overlong_penalty at it (0 = off)
    overlong_penalty: NonNegativeFloat = 0.0
    overlong_buffer: NonNegativeInt = 0
    # the advantage estimator: grpo (advantages.ESTIMATORS; a fork adds its own there)
    advantage: str = "grpo"
    scale_by_std: bool = True  # grpo: False = Dr. GRPO advantages (no std division)
    # pi_old in the ratio: the log-probs of the weights that sampled (update.pi_old_source).
    # trainer: as the trainer computes them (one minibatch: the update's own forward, detached, so
    # the ratio is 1; several: a forward before the first step) | engine: the engine's own, as it
    # sampled (only with one minibatch, no partial rollout, TIS off and top_p 1, where the two are
    # the same policy).
    # engine measures the log-prob gap at a process's first step only: after it, the weight
    # checksums alone watch the engine (run.max_logprob_gap has nothing to read)
    old_logprobs: str = "trainer"
    kl_coef: NonNegativeFloat = 0.0  # KL to a frozen reference copy; 0 = no reference model kept
    kl_estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl (loss.kl_estimate)
    # loss: kl_coef x the per-token KL in the loss | reward: kl_coef x each trajectory's summed KL
    # (from the engine's sampling log-probs) subtracted from its reward before the advantages
    kl_in: str = "loss"
    # entropy bonus: entropy_coef x the token entropy is subtracted from the loss (0 = off)
    entropy_coef: NonNegativeFloat = 0.0
    # more per-token loss terms, {name: coefficient}: loss.TERMS names them (a fork adds its own)
    loss_terms: dict[str, float] = dataclasses.field(default_factory=dict)
    # truncated importance sampling: weight tokens by min(pi_old / pi_engine, cap); 0 = off
    tis_cap: NonNegativeFloat = 0.0
    # a mixture of experts: the trainer routes each token to the experts the engine routed it to
    # (rollout routing replay, R3); its own gates still train. The path: Engine.request ->
    # inflight.Rollout.generate_one -> Sample.routed_experts -> update.route_table ->
    # runtime/routing.py's RouteReplay.hook; logged: train/route_agreement,
    # train/unrouted_sequences, train/routes_refused (choices no router makes: routed by the trainer
    # instead)
    routing_replay: bool = False
    # mask tokens sampled more than this many versions ago out of the loss; -1 = keep. At 0 with
    # partial rollout, a held group's members that finished in an earlier step are masked whole:
    # only its resumed tails train, though every member counts in the group's mean and std
    # (staleness/masked_tokens counts them; train/stale_token_frac, of trained tokens, reads 0)
    max_token_staleness: Annotated[int, Range(ge=-1)] = -1
    # optimizer steps per rollout batch (> 1 makes the ratio clip matter)
    num_minibatches: PositiveInt = 1
    micro_batch_size: PositiveInt = 64  # samples per forward/backward (gradient accumulation)
    # > 0: padding-free training: micro-batches of packed rows, at most this many positions (rows x
    # width; a longer sequence gets one of its own), rows no wider than the longest sequence (with
    # shared_prefix below, the widest group's unit: up to the budget) (update.py); micro_batch_size
    # then sizes only the KL-in-reward reference pass (advantages.py, padded to keep the samples'
    # order). 0: padded micro-batches of micro_batch_size rows. auto: the largest budget whose
    # estimated train phase fits the card with a margin (runtime/estimate.py auto_budget; 4,096
    # without a GPU), chosen and logged at setup
    max_tokens_per_micro_batch: NonNegativeInt | typing.Literal["auto"] = 0
    # packed only: the samples of a GRPO group sit side by side in a row and compute their prompt
    # once, each response reading it through the attention mask (update.row_segments); on a GPU
    # with FlexAttention only (SDPA, whose mask is dense: CPU only). Logged:
    # train/shared_prefix_tokens (train/tokens and perf/train_tokens_per_s count every token)
    shared_prefix: bool = False
    # recompute decoder activations in backward: less memory, ~1/3 more compute
    gradient_checkpointing: bool = False
    # FSDP2 (several ranks): every unit stays gathered in the compute dtype through each optimizer
    # step, one all-gather a step (the whole model on each rank: runtime/parallel.py
    # gathered_for_update); false: each decoder layer gathered for its own forward and again for
    # its backward, every micro-batch (FSDP's default: a layer or two at a time), for a model
    # whose gathered copy does not fit beside the trainer's state (bench/estimate_memory.py)
    fsdp_keep_gathered: bool = True
    # torch.compile each decoder layer and the output head's per-chunk math (runtime/model.py
    # compile_layers, loss.chunk_function): their elementwise work fused into few kernels; costs a
    # compile (seconds to a minute) at the first update. On where it pays: a GPU
    compile: bool = False
    # a non-finite loss or gradient norm skips that update (logged, counted in
    # train/skipped_updates); this many in a row stop the run with a NonFiniteError: the policy is
    # broken, not unlucky
    max_bad_updates: PositiveInt = 3
    threads: PositiveInt = 1  # torch threads of the trainer process
    # the model's init, the prompt order, the tiny tasks' prompts, the engine's sampling seeds
    # (which SGLang reads only with rollout.deterministic, on a GPU: a CPU run's samples differ
    # between runs); a --resume refuses another
    seed: int = 0


@dataclasses.dataclass
class RunConfig:
    out: str = "runs/tiny"  # run directory: config.yaml, tb/, checkpoints/, model/
    # steps between validations (greedy and sampled); each run also validates at its first step
    val_every: PositiveInt = 10
    checkpoint_every: NonNegativeInt = 50  # steps between checkpoints (0 = only at the end)
    # the newest this many checkpoints are kept, older ones removed after each save (0: all; one
    # of Qwen2.5-1.5B is ~25 GB: fp32 weights, AdamW state and the HF export)
    keep_checkpoints: NonNegativeInt = 0
    # data-parallel ranks on this node: 0 = every visible GPU (1 on CPU); > 1 on CPU uses gloo
    nproc: NonNegativeInt = 0
    # greedy validation trajectories written to TensorBoard as text (val/samples)
    log_samples: NonNegativeInt = 4
    # sampled responses per validation prompt: > 1 adds val/pass@k (metrics.pass_at_k, as eval)
    val_samples: PositiveInt = 1
    # Health checks (memory.py), each ending the run with exit 2 and a named error. After a weight
    # push, the engine's tensors are hashed and compared with the trainer's: every push of the
    # first check_weights_first steps of the run (steps 0..N-1: a resumed one past them does not
    # check them again), then every check_weights_every steps (0: not again).
    check_weights_first: NonNegativeInt = 3
    check_weights_every: NonNegativeInt = 10
    # the engine-vs-trainer log-prob gap (train/logprob_gap_max: the largest rank's) above this for
    # max_logprob_gap_steps steps in a row (0: off); the first step's gap has its own, tighter
    # bound per dtype
    max_logprob_gap: NonNegativeFloat = 0.05
    max_logprob_gap_steps: NonNegativeInt = 3
    # write each step's trained sequences under run.out/rollouts/step_NNNNNN (what train.py
    # --replay reads, from the checkpoint of that step: needs checkpoint_every > 0 past one step)
    dump_rollouts: bool = False


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def __post_init__(self):
        """Every number within the Range written beside its field; the choices and the
        combinations are their owners' (`check` in cancel.py, advantages.py, merge.py, loss.py,
        update.py, memory.py, runtime/model.py, task/data.py). A ConfigError names the key."""
        for key, value, allowed in numbers(self):
            if not allowed.admits(value):
                kind = "a finite number" if isinstance(value, float) else "an integer"
                expected = " ".join(filter(None, [kind, str(allowed)]))
                why = f" ({allowed.why})" if allowed.why else ""
                raise ConfigError(f"{key}={shown(value)}: expected {expected}{why}")
        # an empty path is the working directory's own: checkpoints/, model/ and tb/ written there
        for key, value in (("run.out", self.run.out), ("model.path", self.model.path)):
            if not value.strip():
                raise ConfigError(f"{key}={value!r}: expected a path")


def refuse_unread(
    cfg, read_when, fork="say when in READ_WHEN, beside the check of the module that owns it"
):
    """Each field of `read_when` ({"section.field": (is_read(cfg), "when it is read"[, fork])})
    set to a value but its default where `is_read` says nothing reads it is a ConfigError: a value
    nothing reads would look like it took effect. Each owner module declares the fields it reads
    only in some tasks or modes beside its `check`, which calls this; `fork`: what a fork of yours
    that reads the field does about it (an entry's own third element first)."""
    defaults = Config()
    for key, (is_read, when, *own) in read_when.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        default = getattr(getattr(defaults, section), name)
        if value != default and not is_read(cfg):
            # the default as a --set value: JSON's spelling is YAML's (null, "", [], true)
            advice = own[0] if own else fork
            raise ConfigError(
                f"{key}={shown(value)} is read only {when}: unset it (--set "
                f"'{key}={json.dumps(default)}'; a fork of yours that reads it: {advice})"
            )


def numbers(config, prefix=""):
    """(key, value, Range) of every number field in the tree, a plain float admitting any finite
    value; a {name: number} mapping yields each entry (train.loss_terms)."""
    hints = typing.get_type_hints(type(config), include_extras=True)
    for name, kind in hints.items():
        key = f"{prefix}{name}"
        value = getattr(config, name)
        if dataclasses.is_dataclass(value):
            yield from numbers(value, prefix=f"{key}.")
        elif typing.get_origin(kind) in (typing.Union, types.UnionType):  # a number or a word
            if not isinstance(value, str):
                (arm,) = [
                    a for a in typing.get_args(kind) if typing.get_origin(a) is typing.Annotated
                ]
                yield key, value, next(m for m in arm.__metadata__ if isinstance(m, Range))
        elif typing.get_origin(kind) is typing.Annotated:
            yield key, value, next((m for m in kind.__metadata__ if isinstance(m, Range)), Range())
        elif kind is float:
            yield key, value, Range()
        elif typing.get_origin(kind) is dict and typing.get_args(kind)[1] is float:
            for entry, number in value.items():
                yield f"{key}.{entry}", number, Range()


RETIRED = {  # keys a config may still hold, each with what became of it
    "model.dtype": "was replaced by model.compute_dtype (trainer) and model.engine_dtype "
    "(engine); the trainer's parameters are always float32",
    "model.lora_dropout": "was removed: dropout makes the trainer's forward another model than "
    "the engine's (which has none), so pi_old, the ratio and the engine-vs-trainer log-prob gap "
    "would measure its noise (a resumed run failed the gap check at once)",
}


def _coerce(key, value, kind):
    """Check `value` against the field type; ints are accepted where floats are expected."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # int | Literal["auto"]
        words = [
            a
            for arm in typing.get_args(kind)
            for a in typing.get_args(arm)
            if typing.get_origin(arm) is typing.Literal
        ]
        if value in words and isinstance(value, str):
            return value
        (number,) = [
            arm for arm in typing.get_args(kind) if typing.get_origin(arm) is not typing.Literal
        ]
        try:
            return _coerce(key, value, number)
        except ConfigError:
            raise ConfigError(
                f"{key}={shown(value)}: expected {number.__name__} or one of {words}"
            ) from None
    if typing.get_origin(kind) is dict and typing.get_args(kind)[1] is not float:
        # dict[str, bool | int | float | str]: names to scalars (data.chat_template_kwargs)
        scalars = typing.get_args(typing.get_args(kind)[1])
        is_mapping = isinstance(value, dict) and all(
            isinstance(k, str)
            and isinstance(v, scalars)
            and not (isinstance(v, float) and not math.isfinite(v))
            for k, v in value.items()
        )
        if not is_mapping:
            raise ConfigError(
                f"{key}={shown(value)}: expected a mapping of names to booleans, finite numbers "
                "or strings"
            )
        return dict(value)
    if typing.get_origin(kind) is dict:  # dict[str, float]: a YAML mapping of names to numbers
        is_mapping = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            for k, v in value.items()
        )
        if not is_mapping:
            raise ConfigError(f"{key}={shown(value)}: expected a mapping of names to numbers")
        return {k: float(v) for k, v in value.items()}
    if typing.get_origin(kind) is list:  # list[str]: a YAML list of strings
        (item,) = typing.get_args(kind)
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{key}={shown(value)}: expected a list of {item.__name__}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"{key}={shown(value)}: expected {kind.__name__}, got {type(value).__name__}"
        )
    return value


def section_keys():
    """{section: its field names} of the config tree."""
    return {
        section.name: {f.name for f in dataclasses.fields(section.type)}
        for section in dataclasses.fields(Config)
    }


def apply(config, overrides, prefix=""):
    """Write a nested dict of overrides into the dataclass tree, rejecting unknown keys."""
    if not isinstance(overrides, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {shown(overrides)}"
        )
    hints = typing.get_type_hints(type(config))
    for key, value in overrides.items():
        if not isinstance(key, str):  # YAML reads `1:` as 1 and `true:` as True
            where = prefix.rstrip(".") or "config"
            raise ConfigError(f"{where}: key {shown(key)} is not a name; quote it")
        name = f"{prefix}{key[:100]}"
        if name in RETIRED:
            raise ConfigError(f"config key {name!r} {RETIRED[name]}")
        if key not in hints:
            # the key where another section has it (train.max_new_tokens: rollout's), before a
            # near spelling here (which offered train.max_token_staleness, a setting of its own)
            # (both where they differ: rollout.threads is rollout.engine_threads or train.threads)
            elsewhere = [f"{s}.{key}" for s, fields in section_keys().items() if key in fields]
            close = elsewhere + [prefix + c for c in difflib.get_close_matches(key, hints, n=1)]
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ConfigError(f"unknown config key {name!r}; {hint}known here: {sorted(hints)}")
        if dataclasses.is_dataclass(hints[key]):
            apply(getattr(config, key), value, prefix=f"{name}.")
        else:
            setattr(config, key, _coerce(name, value, hints[key]))


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader (no tags that build objects), reading booleans and numbers as YAML
    1.2 does, which PyYAML (a YAML 1.1 reader) does not: `010` is 10, not 8 (1.1's octal), `1e-3`
    a float, not a string; `1:30` is a string, not 90 (1.1's base 60), and so are `yes`, `no`,
    `on`, `off` and `2026-11-27` (1.1: booleans and a date). A seed or a count typed with a
    leading zero must not change. A key written twice in one mapping is a ConfigError (PyYAML
    keeps the last: the first value, or a whole section, would be lost unseen)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = self.construct_object(key_node)
                if key in seen:
                    raise ConfigError(
                        f"{key!r} is written twice in one mapping (line "
                        f"{key_node.start_mark.line + 1}): only the last would be read"
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


def _yaml12_int(loader, node):
    """An int as YAML 1.2 writes one: decimal (`010` is 10), 0o octal or 0x hexadecimal."""
    text = loader.construct_scalar(node)  # matched by the int pattern below, or tagged !!int
    try:
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)
    except ValueError as e:  # (!!int abc; over Python's 4,300 digits): a YAML error
        raise yaml.constructor.ConstructorError(
            None, None, f"not an integer: {shown(text, 40)}: {str(e)[:200]}", node.start_mark
        ) from None


class Yaml12Dumper(yaml.SafeDumper):
    """Writes what Yaml12Loader reads back as the same values: a string that 1.2 would read as a
    number or a boolean (`1e3`, `010`) is quoted."""


YAML12 = {  # YAML 1.2's core schema (yaml.org/spec/1.2.2, section 10.3.2)
    "tag:yaml.org,2002:bool": (r"true|True|TRUE|false|False|FALSE", "tTfF"),
    "tag:yaml.org,2002:int": (r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    "tag:yaml.org,2002:float": (
        r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)",
        "-+0123456789.",
    ),
}
TIMESTAMP = {"tag:yaml.org,2002:timestamp"}


def _use_yaml12(cls):
    """Give `cls` (a loader or a dumper class) YAML12's patterns in place of 1.1's for its tags, and
    no timestamps (1.2 has none: `--set run.out=2026-11-27` is a string, not a date)."""
    cls.yaml_implicit_resolvers = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag not in {*YAML12, *TIMESTAMP}]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    for tag, (pattern, firsts) in YAML12.items():
        cls.add_implicit_resolver(tag, re.compile(f"^(?:{pattern})$"), list(firsts))


_use_yaml12(Yaml12Loader)
_use_yaml12(Yaml12Dumper)
Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _yaml12_int)


def load_yaml(stream):
    """A YAML document (text or a file) as plain values, read as YAML 1.2 (Yaml12Loader)."""
    return yaml.load(stream, Loader=Yaml12Loader)


def config_yaml(config):
    """Every setting of `config` as YAML text that load_yaml reads back to the same values (what
    config.yaml in the run directory and in each checkpoint holds, and --print-config prints)."""
    return yaml.dump(dataclasses.asdict(config), Dumper=Yaml12Dumper, sort_keys=False)


def read_yaml(path):
    """The YAML file at `path`, parsed safely (no tags that build objects); a file that cannot be
    read, is not UTF-8 or is not YAML is a one-line ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            return load_yaml(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:  # a directory, no permission, ...
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {shown(str(e), 300)}") from None
    except ConfigError as e:  # a key written twice (Yaml12Loader)
        raise ConfigError(f"{path}: {e}") from None


def yaml_quoted(text):
    """`text` as a YAML double-quoted scalar that reads back exactly: every character but
    printable ASCII escaped (YAML folds U+0085 and U+2028 as line breaks, and refuses DEL and
    other unprintable characters even inside quotes)."""
    printable = (c if " " <= c <= "~" and c not in '"\\' else f"\\U{ord(c):08x}" for c in text)
    return '"' + "".join(printable) + '"'


def read_config(path=None, sets=(), values=None):
    """Defaults <- YAML file (or `values`, a mapping as one holds) <- `section.key=value` strings
    (values parsed as YAML scalars), each value of the right type and within its bounds. The
    choices are checked by their owners: assemble.load_config runs both, and is what a run uses."""
    config = Config()
    if values is not None:
        apply(config, values)
    elif path:
        apply(config, read_yaml(path) or {})
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        *sections, leaf = key.split(".")
        try:
            value = load_yaml(text)
        except yaml.YAMLError as e:
            problem = " ".join(str(getattr(e, "problem", None) or e).split())[:300]
            raise ConfigError(
                f"--set {shown(item, 200)}: the value is not a valid YAML scalar ({problem})"
            ) from None
        if text.count("#") > repr(value).count("#"):  # a path or name cut at " #", silently
            raise ConfigError(
                f"--set {item!r}: a '#' after a space starts a YAML comment, which cut the value "
                f"to {value!r}: if the '#' is part of it, quote it (--set "
                f"{shlex.quote(key + '=' + yaml_quoted(text))}), else leave the comment out"
            )
        owner = mapping_owner(config, sections)
        if owner is not None:  # one entry of a mapping (train.loss_terms.x=0.1): the others stay
            value = {**getattr(owner, sections[-1]), leaf: value}
            *sections, leaf = sections
        nested = {leaf: value}
        for section in reversed(sections):
            nested = {section: nested}
        apply(config, nested)
    config.__post_init__()  # re-validate the bounds after overrides
    return config


def mapping_owner(config, sections):
    """The section holding the mapping field that `sections` ends in (["train", "loss_terms"]: the
    train section), or None: where a --set names one entry of a mapping, which then joins the
    mapping's other entries (a whole mapping given as the value replaces them)."""
    owner = config
    for section in sections[:-1]:
        owner = getattr(owner, section, None)
        if not dataclasses.is_dataclass(owner):
            return None
    if sections and isinstance(getattr(owner, sections[-1], None), dict):
        return owner
    return None


def check_function_spec(spec, key):
    """A config string naming a function, checked without running anything (at load, so that
    --print-config catches it too): its form, "path/to/file.py:function" or "module:function",
    and a .py file's existence. Returns (where, function name)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(
            f"{key}={spec!r}: expected 'path/to/file.py:function' or 'module:function'"
        )
    if where.endswith(".py") and not os.path.isfile(where):
        raise ConfigError(f"{key}={spec!r}: no file {where}")
    return where, name


def raised_at(error):
    """ ", at FILE:LINE" where `error` was raised (a helper module the user's file imports, where a
    bare KeyError names neither), and where that is inside Python's library or the installed
    packages, the last line outside them first (the user's line that called json.loads; a module
    spec's package's own line); "" where it was our own import call."""
    paths = sysconfig.get_paths()
    packages = tuple({os.path.join(paths[key], "") for key in ("purelib", "platlib")})
    stdlib = tuple({os.path.join(paths[key], "") for key in ("stdlib", "platstdlib")})
    library = stdlib + packages
    machinery = os.path.dirname(importlib.__file__)  # and <frozen importlib._bootstrap>
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if f.filename[:1] != "<" and not f.filename.startswith(machinery)
    ]
    if not frames or frames[-1].filename == __file__:
        return ""
    last = f"{frames[-1].filename}:{frames[-1].lineno}"
    ours = [f for f in frames if f.filename != __file__]
    # the user's own code, else an installed package's (a module spec's), else where it raised
    users = [f for f in ours if not f.filename.startswith(library)]
    # (site-packages sits inside the standard library's folder: lib/python3.11/site-packages)
    package = [
        f for f in ours if f.filename.startswith(packages) or not f.filename.startswith(stdlib)
    ]
    users = users or package or frames
    if users[-1] is frames[-1]:
        return f", at {last}"
    return f", at {users[-1].filename}:{users[-1].lineno} (raised in {last})"


def load_function(spec, key):
    """The function a config string names: "path/to/file.py:function" or "module:function"
    (importable from the working directory). A missing file, module or function is a ConfigError
    naming `key`, before the engine starts."""
    where, name = check_function_spec(spec, key)
    try:
        if where.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(
                f"user_{os.path.basename(where)[:-3]}", where
            )
            module = importlib.util.module_from_spec(module_spec)
            # registered first, as importlib's recipe does: a dataclass in the file looks its
            # module up there (with `from __future__ import annotations` it failed on a missing
            # entry)
            sys.modules[module_spec.name] = module
            # its folder importable (after ours: it shadows nothing), so it may import a helper
            # module beside it, at load or later
            folder = os.path.dirname(os.path.abspath(where))
            if folder not in sys.path:
                sys.path.append(folder)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (Exception, SystemExit) as e:  # a syntax error, a missing import, a raise at load
        raise ConfigError(
            f"{key}={spec!r}: cannot import {where!r} ({type(e).__name__}: {e}{raised_at(e)})"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {where} has no function {name!r}")
    return fn
