"""Setting up a run: the `Run` the step loop reads, built once per rank by `setup`.

Owns building the policy (sharded over ranks), the task, the rollout engine, the optimizer and the
partial-rollout buffer, and restoring them from the latest checkpoint on `--resume`. Does not own
the training step or the loop (train.py), checkpoint files (checkpoint.py) or the model code
(model.py).
"""

import dataclasses
import logging

import torch

import checkpoint
import parallel
from buffer import PartialBuffer, share_state
from cancel import plan_launch
from config import Config, ConfigError
from model import build_optimizer, build_policy, check_attention
from rollout import RolloutEngine
from tasks import PromptStream, build_task

log = logging.getLogger("setup")


@dataclasses.dataclass
class Run:
    """Everything the loop needs, built once by `setup` (`trainer_only` and `engine_only` fill
    half of it; the rest stays None)."""

    cfg: Config
    policy: torch.nn.Module | None = None  # fp32 master weights; an FSDP2 shard with several ranks
    # frozen initial policy for the KL term (only when kl_coef > 0)
    reference: torch.nn.Module | None = None
    tokenizer: object = None
    stream: PromptStream | None = None  # this rank's training prompts; its position is checkpointed
    val_prompts: list = dataclasses.field(default_factory=list)
    reward_fn: object = None  # (response_text, answer, finished) -> float; see rewards.py
    tool: object = None  # tools.QwenTools or tools.QuestionCalculator for multi-turn tasks
    engine: RolloutEngine | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    device: torch.device | None = None
    # one rank computing in bf16; None for fp32 or under FSDP2
    autocast_dtype: torch.dtype | None = None
    # partial rollout's unfinished samples and held groups; None when off
    buffer: PartialBuffer | None = None
    start_step: int = 0
    # optimizer steps the policy holds (the step a checkpoint after a fault records)
    updates_done: int = 0


def setup(cfg, resume=False, engine=None):
    """Build policy, task, engine and optimizer on this rank; with `resume`, restore the latest
    checkpoint. An `engine` passed in (tests share one) is synced to the policy instead of
    starting another."""
    torch.set_num_threads(cfg.train.threads)  # the engine's processes need the other core(s)
    world = parallel.world_size()
    if cfg.rollout.prompts_per_step % world:
        raise ConfigError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must divide evenly over "
            f"{world} ranks (each rank takes whole GRPO groups)"
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", parallel.gpu_index())
    else:
        device = torch.device("cpu")
    check_attention(cfg, device)
    resume_dir = checkpoint.latest(cfg.run.out) if resume else None
    if resume and resume_dir is None:
        raise ConfigError(f"--resume: no checkpoint under {cfg.run.out}/checkpoints")
    state = checkpoint.read_trainer_state(resume_dir) if resume_dir else {}
    start_step = state.get("step", 0)
    policy, tokenizer = build_policy(cfg, resume_dir)
    task = build_task(cfg, tokenizer)
    # the weights the engine loads (run.out/model: the initial policy), or the checkpoint's
    engine_dir = resume_dir or checkpoint.export_for_engine(policy, tokenizer, cfg.run.out)
    shared_engine = engine is not None
    if engine is None:
        # before the trainer takes device memory: the engine sizes its KV cache from what is free
        engine = start_engine(cfg, engine_dir, start_step)
    compute_dtype = getattr(torch, cfg.model.compute_dtype)
    policy, reference = place_models(cfg, policy, compute_dtype, device)
    optimizer, scheduler = build_optimizer(policy, cfg.train)
    if resume_dir:
        checkpoint.restore(resume_dir, state, policy, optimizer, scheduler)
    if shared_engine:  # an engine we started loaded exactly these weights from engine_dir
        engine.update_weights(
            policy.named_parameters(), version=start_step, gather=parallel.full_tensor
        )
    stream = PromptStream.for_rank(
        task.train_prompts,
        cfg.train.seed,
        parallel.rank(),
        world,
        positions=state.get("prompt_positions"),
    )
    return Run(
        cfg=cfg,
        policy=policy,
        reference=reference,
        tokenizer=tokenizer,
        stream=stream,
        val_prompts=task.val_prompts,
        reward_fn=task.reward_fn,
        tool=task.tool,
        engine=engine,
        optimizer=optimizer,
        scheduler=scheduler,
        device=device,
        autocast_dtype=compute_dtype if world == 1 and compute_dtype != torch.float32 else None,
        buffer=partial_buffer(cfg, state.get("buffer"), multi_turn=task.tool is not None),
        start_step=start_step,
        updates_done=start_step,
    )


def trainer_only(cfg, policy, device=torch.device("cpu"), autocast_dtype=None):
    """A Run holding only the trainer half (no engine, no data), with the optimizer and schedule
    `model.build_optimizer` makes: what train.train_on_rollout reads. For the benchmarks and tests
    that time or check an update alone."""
    check_attention(cfg, device)
    optimizer, scheduler = build_optimizer(policy, cfg.train)
    return Run(
        cfg=cfg,
        policy=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        device=device,
        autocast_dtype=autocast_dtype,
    )


def engine_only(cfg, engine, tokenizer, task):
    """A Run holding only the engine and the task (no policy, no optimizer): what eval.py's
    sampling and scoring read."""
    return Run(
        cfg=cfg,
        tokenizer=tokenizer,
        val_prompts=task.val_prompts,
        reward_fn=task.reward_fn,
        tool=task.tool,
        engine=engine,
    )


def place_models(cfg, policy, compute_dtype, device):
    """(policy, KL reference or None) on `device`, each an FSDP2 shard with several ranks. The
    reference is the *initial* policy, also after a resume: built again, not copied."""
    reference = None
    if cfg.train.kl_coef > 0:
        reference = build_policy(cfg, None)[0].requires_grad_(False).eval()
    models = []
    for model in (policy, reference):
        if model is not None and parallel.world_size() > 1:
            model = parallel.shard(model, compute_dtype)
        if model is not None:
            model.to(device)
        models.append(model)
    return models[0], models[1]


def start_engine(cfg, model_dir, start_step):
    """This rank's SGLang engine, serving the weights in `model_dir` as version `start_step`."""
    engine = RolloutEngine(
        model_dir,
        cfg.rollout,
        dtype=cfg.model.engine_dtype,
        seed=cfg.train.seed + start_step + 100_003 * parallel.rank(),
        gpu_id=parallel.gpu_index(),
        local_rank=parallel.local_rank(),
        trust_remote_code=cfg.model.trust_remote_code,
    )
    engine.weight_version = start_step
    return engine


def partial_buffer(cfg, state, multi_turn):
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
    buffer = PartialBuffer(cfg.rollout.group_size, cfg.rollout.max_staleness, multi_turn)
    if state:
        buffer.load_state_dict(share_state(state, parallel.rank(), parallel.world_size()))
    return buffer
