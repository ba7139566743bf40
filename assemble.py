"""Setting up a run: loading and checking its config, and the `Run` the step loop reads, built once
per rank by `setup`. The assembly sits above the stages it assembles (beside train.py): it imports
them all, and nothing under runtime/ (the substrate a step runs on) imports a stage.

Owns building the policy (sharded over ranks), the task, the rollout engine, the optimizer, the
reward step, the memory phases and partial rollout's buffer, and restoring them from the latest
checkpoint on `--resume`. Does not own the training step or the loop (train.py), checkpoint files
(runtime/checkpoint.py) or the model code (runtime/model.py).
"""

import dataclasses
import logging
import math

import torch

import advantages
import cancel
import config
import extras.replay as replay
import loss
import memory
import merge
import rewards
import runtime.seeds as seeds
import update
from cancel import plan_launch
from config import Config, ConfigError
from partial import PartialBuffer, share_state
from runtime.engine import request_limits
from rollout import RolloutEngine
import runtime.checkpoint as checkpoint
import runtime.estimate as estimate
import runtime.model as model
import runtime.parallel as parallel
import runtime.lora as lora
from runtime.model import TINY_CHARS, build_policy, build_reference, check_attention, load_tokenizer
import task.data as data
from task.data import PromptStream, build_task, vocabulary

log = logging.getLogger("setup")

# every module with choices or combinations of its own to check at load (each its `check(cfg)`)
CHECKED_BY = (cancel, advantages, merge, loss, update, memory, model, data, replay)


def load_config(path=None, sets=()):
    """The run's Config: config.py's defaults <- the YAML file <- `section.key=value` strings,
    each value of the right type and within its bounds (config.py), then each choice and
    combination checked by the module that reads it. A ConfigError names the key, before any
    model or engine starts."""
    cfg = config.read_config(path, sets)
    for module in CHECKED_BY:
        module.check(cfg)
    return cfg


@dataclasses.dataclass
class Run:
    """Everything the loop needs, built once by `setup` (`engine_only` fills part of it; the rest
    stays None). Each field is owned by the stage that uses it."""

    cfg: Config
    trainer: update.Trainer | None = None  # the update's: policy, reference, optimizer, schedule
    tokenizer: object = None
    stream: PromptStream | None = None  # this rank's training prompts; its position is checkpointed
    val_prompts: list = dataclasses.field(default_factory=list)
    rewards: "rewards.Rewards | None" = None  # the reward step the rollout scores with
    tool: object = None  # task.tools.QwenTools or QuestionCalculator for multi-turn tasks
    engine: RolloutEngine | None = None
    # the rollout's: partial rollout's unfinished samples and held groups; None when off
    buffer: PartialBuffer | None = None
    phases: memory.MemoryPhases | None = None  # the memory phases the weight sync moves through
    gap_watch: memory.GapWatch | None = None  # the weight sync's log-prob gap check
    start_step: int = 0
    # steps whose update the policy holds (the step a checkpoint after a fault records)
    updates_done: int = 0


def check_run(cfg, world, resume):
    """The refusals that need no model: each of `world` ranks takes whole groups, and the run
    folder matches --resume. Called by `setup` on each rank, and by train.main before it starts
    ranks (there a refusal is one line, not every rank's error). Returns the checkpoint folder to
    resume from, or None."""
    if cfg.rollout.prompts_per_step % world:
        raise ConfigError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must divide evenly over "
            f"{world} ranks (each rank takes whole GRPO groups)"
        )
    cancel.check_shares(cfg.rollout, world)
    resume_dir = checkpoint.latest(cfg.run.out)
    if resume and resume_dir is None:
        raise ConfigError(f"--resume: no checkpoint under {cfg.run.out}/checkpoints")
    if not resume and resume_dir:  # a later --resume would take the newest, whichever run wrote it
        step = checkpoint.step_of(resume_dir)
        more = f" with train.steps above {step}" if step >= cfg.train.steps else ""  # (it ended)
        raise ConfigError(
            f"run.out={cfg.run.out!r} holds an earlier run's checkpoints (the latest: "
            f"{resume_dir}): --resume{more} continues that run; to start a new one, pass another "
            "--out or remove that folder"
        )
    return resume_dir


def setup(cfg, resume=False, engine=None):
    """Build policy, task, engine and optimizer on this rank; with `resume`, restore the latest
    checkpoint. An `engine` passed in (tests share one) is synced to the policy instead of
    starting another. The trainer's memory is offloaded last: the first step's rollout comes
    first."""
    torch.set_num_threads(cfg.train.threads)  # the engine's processes need the other core(s)
    world = parallel.world_size()
    resume_dir = check_run(cfg, world, resume)
    if parallel.rank() == 0 and (moved := cancel.rounded_shares(cfg.rollout, world)):
        log.warning(moved)
    if torch.cuda.is_available():
        device = torch.device("cuda", parallel.gpu_index())
    else:
        device = torch.device("cpu")
    check_attention(cfg, device)
    state = checkpoint.check_resume(resume_dir, cfg) if resume_dir else {}
    start_step = state.get("step", 0)
    if start_step > cfg.train.steps:  # the loop would run no step and exit as if it had finished
        raise ConfigError(
            f"--resume: {resume_dir} is at step {start_step}, past train.steps={cfg.train.steps}; "
            f"to train on, set train.steps above {start_step}"
        )
    init_dir = checkpoint.init_folder(resume_dir, cfg)
    chars = vocabulary(cfg, TINY_CHARS)
    # the task first (its rows read, its reward file loaded): a bad row file or reward is named in
    # seconds, before a model of gigabytes loads (the tokenizer alone, again below: the same)
    task = build_task(cfg, load_tokenizer(cfg, init_dir or cfg.model.path, chars))
    policy, tokenizer = build_policy(cfg, init_dir, chars)
    check_fits_a_request(cfg, task, policy.config)
    # the budget and the estimate's warning before the engine's start-up (it reads the shape only)
    size_micro_batches(cfg, policy, card_bytes(device))
    # the weights the engine loads (run.out/model: the initial policy, with LoRA the base), or the
    # checkpoint's
    engine_dir = init_dir or checkpoint.export_for_engine(policy, tokenizer, cfg.run.out)
    shared_engine = engine is not None
    if engine is None:
        # before the trainer takes device memory: the engine sizes its KV cache from what is free
        engine = start_engine(cfg, engine_dir, start_step)
    elif cfg.train.routing_replay and not engine.routing_replay:
        raise ConfigError(
            "train.routing_replay: the engine passed in records no routes (started without "
            "routing_replay)"
        )
    compute_dtype = getattr(torch, cfg.model.compute_dtype)
    policy, reference = place_models(cfg, policy, compute_dtype, device)
    trainer = update.Trainer.build(
        cfg,
        policy,
        device,
        reference=reference,
        autocast_dtype=compute_dtype if world == 1 and compute_dtype != torch.float32 else None,
        first_step=start_step,
    )
    if resume_dir:
        checkpoint.restore(resume_dir, state, trainer, cfg.train)
    # a shared engine serves other weights: push them all; a LoRA engine holds the base and serves
    # the adapter from its pool: push it (an engine we started loaded the rest from engine_dir)
    if shared_engine or cfg.model.lora_rank:
        bucket = cfg.memory.bucket_mb << 20
        memory.push_weights(engine, policy, start_step, bucket, everything=shared_engine)
    phases = memory.MemoryPhases(
        engine,
        policy,
        trainer.optimizer,
        mode=cfg.memory.mode,
        bucket_bytes=cfg.memory.bucket_mb << 20,
        engine_dtype=engine.dtype,
        # a LoRA run's reference is the policy itself: nothing more to count or move
        reference=reference if isinstance(reference, torch.nn.Module) else None,
        device=trainer.device,
    )
    phases.start()
    stream = PromptStream.for_rank(
        task.train_prompts,
        cfg.train.seed,
        parallel.rank(),
        world,
        positions=state.get("prompt_positions"),
    )
    return Run(
        cfg=cfg,
        trainer=trainer,
        tokenizer=tokenizer,
        stream=stream,
        val_prompts=task.val_prompts,
        rewards=rewards.Rewards(task.reward_fn, tokenizer, cfg, task.tool),
        tool=task.tool,
        engine=engine,
        buffer=partial_buffer(cfg, state.get("buffer")),
        phases=phases,
        gap_watch=memory.GapWatch(cfg, first_step=start_step, over=state.get("gap_steps", 0)),
        start_step=start_step,
        updates_done=start_step,
    )


def engine_only(cfg, engine, tokenizer, task):
    """A Run holding only the engine, the task and its reward step (no policy, no optimizer):
    what extras/eval.py's sampling and scoring read."""
    return Run(
        cfg=cfg,
        tokenizer=tokenizer,
        val_prompts=task.val_prompts,
        rewards=rewards.Rewards(task.reward_fn, tokenizer, cfg, task.tool),
        tool=task.tool,
        engine=engine,
    )


def trainer_only(cfg, policy, device=torch.device("cpu"), autocast_dtype=None, reference=None):
    """The trainer half alone (no engine, no data), with the optimizer and schedule
    `model.build_optimizer` makes: what update.update_policy reads. For replay, the benchmarks
    and the tests that time or check an update alone."""
    check_attention(cfg, device)
    size_micro_batches(cfg, policy, card_bytes(device))
    return update.Trainer.build(cfg, policy, device, reference, autocast_dtype)


def card_bytes(device):
    """The GPU's memory in bytes (what size_micro_batches sizes for); None on a CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def size_micro_batches(cfg, policy, card):
    """`train.max_tokens_per_micro_batch: auto` becomes a number of tokens here, once, written
    into the config (logged): with a GPU of `card` bytes, the largest budget whose estimated train
    phase fits it with a margin (estimate.auto_budget, at this run's rank count and the policy's
    shape), so a bigger card or more ranks get bigger micro-batches; without one (`card` None)
    CPU_AUTO_TOKENS. With a GPU, a run whose estimated peak is more than the card gets a warning
    (estimate.over_the_card), auto or not."""
    auto = cfg.train.max_tokens_per_micro_batch == "auto"
    if card is None:
        if auto:
            cfg.train.max_tokens_per_micro_batch = estimate.CPU_AUTO_TOKENS
            log.info(
                "train.max_tokens_per_micro_batch: auto -> %d (no GPU)", estimate.CPU_AUTO_TOKENS
            )
        return
    shape = estimate.shape_of(policy.config, cfg.model.trust_remote_code)
    ranks = parallel.world_size()
    if auto:
        budget = estimate.auto_budget(cfg, ranks, card, shape)
        cfg.train.max_tokens_per_micro_batch = budget
        why = f"the estimated train phase on this {card / 2**30:.1f} GiB card"
        log.info("train.max_tokens_per_micro_batch: auto -> %d (%s)", budget, why)
    warning = estimate.over_the_card(cfg, ranks, card, shape)
    if warning:
        log.warning(warning)


def place_models(cfg, policy, compute_dtype, device):
    """(policy, KL reference or None: model.build_reference) on `device`, each an FSDP2 shard with
    several ranks."""
    reference = build_reference(cfg, policy, vocabulary(cfg, TINY_CHARS))
    # a LoRA base is the policy's own parameters (sharded with it, in place): nothing more to place
    own = isinstance(reference, lora.Base)
    models = []
    for module, is_reference in ((policy, False), (None if own else reference, True)):
        if module is not None and parallel.world_size() > 1:
            module = parallel.shard(module, compute_dtype)
            if is_reference:
                # no backward ever reshards the reference (it runs no-grad forwards only): its
                # root would stay gathered through the update and the sync (FSDP's root default)
                module.set_reshard_after_forward(True)
        if module is not None:
            module.to(device)
        models.append(module)
    return models[0], reference if own else models[1]


def start_engine(cfg, model_dir, start_step, training=True, folder_head=False):
    """This rank's SGLang engine, serving the weights in `model_dir` as version `start_step`;
    recording routes (train.routing_replay) only for `training`. Its head as model.fp32_head
    says, or with `folder_head` (eval of any HF folder) as the folder's config.json does unless
    the config sets it on."""
    engine = RolloutEngine(
        model_dir,
        cfg.rollout,
        dtype=cfg.model.engine_dtype,
        seed=seeds.derive(cfg.train.seed, "engine", start_step, parallel.rank()),
        gpu_id=parallel.gpu_index(),
        local_rank=parallel.local_rank(),
        trust_remote_code=cfg.model.trust_remote_code,
        lora=lora_engine(cfg.model),
        routing_replay=training and cfg.train.routing_replay,
        fp32_head=(cfg.model.fp32_head or None) if folder_head else cfg.model.fp32_head,
    )
    engine.set_version(start_step)  # the weights it loaded are version start_step
    return engine


def lora_engine(m):
    """The engine's LoRA pool for model section `m` (None without LoRA)."""
    return dict(rank=m.lora_rank, targets=m.lora_targets) if m.lora_rank else None


def check_fits_a_request(cfg, task, model_config):
    """The longest trajectory fits one engine request (runtime/engine.py, `request_limits`): past
    that SGLang cuts the response short, unseen by the trainer (its budget, mask_truncated and
    the overlong penalty assume the whole budget), or refuses the request. A later request's
    prompt holds what came before it: with tools' turns the earlier turns, with partial rollout
    the cancelled response it resumes (inflight.py); up to the prompt and the budget but one."""
    splits = [
        [len(p.prompt_ids) for p in prompts] for prompts in (task.train_prompts, task.val_prompts)
    ]
    longest = max(max(lengths, default=0) for lengths in splits)
    budget = cfg.rollout.max_trajectory_tokens()
    most, longest_prompt = request_limits(model_config, cfg.rollout.max_total_tokens)
    continued = cfg.rollout.max_turns > 1 or cfg.rollout.resumes()
    last_prompt = longest + (budget - 1 if continued else 0)
    over = max(longest + budget - most, last_prompt - longest_prompt)
    if over > 0:
        # a first prompt over its own limit: no budget gives that back
        prompt_over = 0 if continued else last_prompt - longest_prompt
        # how much more a larger KV pool would hold (rollout.max_total_tokens below the context)
        pool_room = request_limits(model_config, 0)[0] - most
        ways = ways_to_fit(cfg.rollout, splits, longest, over, prompt_over, pool_room)
        raise ConfigError(
            f"a trajectory needs up to {longest + budget} tokens (its prompt, up to {longest}, and "
            f"rollout's budget {budget}) and sends a prompt of up to {last_prompt}, but one engine "
            f"request holds {most} and a prompt {longest_prompt} (the model's context length, "
            f"rollout.max_total_tokens when set): {over} tokens too many; " + "; or ".join(ways)
        )


def ways_to_fit(r, splits, longest, over, prompt_over=0, pool_room=0):
    """The settings that give back `over` tokens (the prompt and the budget each count once in
    both limits, the KV pool's size in both): the field that sets the budget
    (config.max_trajectory_tokens), unless the first prompt alone is over its limit
    (`prompt_over` > 0); a shorter prompt bound where each split keeps a prompt; a larger
    rollout.max_total_tokens where the pool, not the context, is the limit (`pool_room`: how much
    more the context holds). A way that cannot be set is left out."""
    ways = []
    if r.max_response_tokens and (r.max_turns > 1 or r.max_response_tokens < r.max_new_tokens):
        field, value = "max_response_tokens", r.max_trajectory_tokens() - over
    else:  # max_new_tokens x max_turns: each turn gives back max_turns tokens
        field, value = "max_new_tokens", r.max_new_tokens - math.ceil(over / r.max_turns)
    if value >= 1 and prompt_over <= 0:
        ways.append(f"set rollout.{field} to {value}")
    if over <= pool_room:
        ways.append(f"set rollout.max_total_tokens to {r.max_total_tokens + over}")
    kept = [sum(n <= longest - over for n in lengths) for lengths in splits]
    if all(k or not lengths for k, lengths in zip(kept, splits)):
        counts = " and ".join(
            f"{k} of {len(n)} {name}" for k, n, name in zip(kept, splits, ("train", "val")) if n
        )
        ways.append(f"set data.max_prompt_len to {longest - over} (keeps {counts} prompts)")
    return ways or ["a model with a longer context (the prompts alone leave no room)"]


def partial_buffer(cfg, state):
    """Partial rollout's buffer (None when off), holding this rank's share of a checkpoint's
    unfinished samples and held groups (`state`, or None)."""
    if not plan_launch(cfg.rollout, 1).partial:
        if state:
            log.warning(
                "the checkpoint holds %d partial-rollout groups; rollout.partial is off: "
                "not resumed",
                len(state["groups"]),
            )
        return None
    buffer = PartialBuffer(
        cfg.rollout.group_size,
        cfg.rollout.max_staleness,
        cfg.rollout.max_trajectory_tokens(),
    )
    if state:
        buffer.load_state_dict(share_state(state, parallel.rank(), parallel.world_size()))
    return buffer
