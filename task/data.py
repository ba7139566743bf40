"""Tasks: what a run trains and validates on, each a module of task/ that data.task names
(built in: task/tiny.py, the CPU demo; tiny_tool.py, its calculator demo; gsm8k.py; chat.py, your
own rows and reward; reverse.py, the smallest complete example; any module added to task/ is found
by its name, `task_names`), and the prompt stream each rank reads.

A task module has `FIELDS` (the config fields it reads beyond data.task, data.reward,
data.max_prompt_len and data.num_val_prompts), `prompts(cfg, tokenizer, split, seed, tool)` ("train"
or "val": a list of sample.Prompt) and `reward(response_text, answer, finished)` (None: data.reward
must name one); and where it needs them `CHARS` (characters its text needs in the tiny model's
vocabulary), `tool(cfg, tokenizer)` (its trajectories' tool, called when rollout.max_turns > 1),
`answer_of(text)` (what eval's maj@k votes on) and `check(cfg)` (its own start-up checks). A new
built-in task is one such module, a config and a test. This module finds and checks them, builds
the run's `Task`, and owns `PromptStream`. Does not own the rewards (rewards.py), the tools
(tools.py), the model or the engine.
"""

import dataclasses
import functools
import importlib
import logging
import math
import os
import pkgutil
import random

import rewards
import runtime.seeds as seeds
from config import ConfigError, DataConfig, check_function_spec, refuse_unread

# the fields any task may read (never refused); the rest of the data section is read by the tasks
# that list it in their FIELDS, and the tool fields only with tools' turns (rollout.max_turns > 1).
# A setting a new task needs is a field of config.DataConfig that its FIELDS lists.
COMMON_FIELDS = {"data.task", "data.reward", "data.max_prompt_len", "data.num_val_prompts"}
TOOL_FIELDS = {
    "rollout.tools",
    "rollout.tool_timeout_s",
    "rollout.tool_workers",
    "rollout.max_observation_chars",
}
TASK_FIELDS = {f"data.{f.name}" for f in dataclasses.fields(DataConfig)} - COMMON_FIELDS
LOCAL_FORMATS = (".jsonl", ".parquet")  # a dataset file's extension, in any case

log = logging.getLogger("task")


class DataError(ValueError):
    """A data source that cannot be used at all (missing file, no usable rows)."""


def task_module(name):
    """The module of task/ that data.task `name` names (imported at first use: the task modules
    import this one, so it cannot import them at its own import)."""
    return importlib.import_module(f"task.{name}")


def module_names():
    """Every module in task/, by name."""
    return [info.name for info in pkgutil.iter_modules(importlib.import_module("task").__path__)]


@functools.cache
def task_names():
    """Every module of task/ that is a task (has `prompts`), sorted: what data.task may name, as
    error messages list it. A module that fails to import is left out, logged (one being written
    must not break every other task's run)."""
    names = []
    for name in module_names():
        try:
            module = task_module(name)
        except Exception as e:
            log.warning("task/%s.py is no task: it fails to import (%r)", name, e)
            continue
        if hasattr(module, "prompts"):
            names.append(name)
    return tuple(sorted(names))


def fields_read(cfg):
    """The task-specific fields (TASK_FIELDS, TOOL_FIELDS) the configured task, turns and data
    files read."""
    listed = task_module(cfg.data.task).FIELDS
    read = listed - TOOL_FIELDS if cfg.rollout.max_turns == 1 else set(listed)
    sources = [source for source in (cfg.data.train_path, cfg.data.val_path) if source]
    if sources and all(os.path.splitext(s)[1].lower() in LOCAL_FORMATS for s in sources):
        read -= {"data.hub_subset"}  # a configuration is a hub dataset's (task/chat.read_rows)
    return read


def read_when(key):
    """config.refuse_unread's entry for one of this module's fields: when `fields_read` reads it,
    and what a fork that reads it does (a reviewer found a shipped task's tool field, refused at
    one turn, told to list it in FIELDS, which the task already did)."""
    listed, fork = "by the tasks whose FIELDS list it (task/*.py)", "list it in its FIELDS"
    if key in TOOL_FIELDS:
        listed += " at rollout.max_turns > 1 (tools run between turns)"
        fork += " and set rollout.max_turns above 1"
    elif key == "data.hub_subset":
        listed += " reading a hub dataset (data.train_path, val_path: not .jsonl/.parquet files)"
        fork += " and read a hub dataset"
    return (lambda cfg: key in fields_read(cfg), listed, fork)


# config.refuse_unread's table of this module's fields
READ_WHEN = {key: read_when(key) for key in sorted(TASK_FIELDS | TOOL_FIELDS)}


def check(cfg):
    """data.task's choice, its module (`check_module`), tools' turns only with a task that has a
    tool, what the task needs (its own `check`), and no task-specific field set that the task or
    its turns do not read (assemble.load_config calls this at load)."""
    name = cfg.data.task
    if name not in module_names():
        raise ConfigError(f"data.task={name!r}: expected one of {task_names()} (task/*.py)")
    module = task_module(name)  # its own import error, raised as is, names its file
    check_module(name, module)
    if cfg.rollout.max_turns > 1 and not hasattr(module, "tool"):
        with_tool = [n for n in task_names() if hasattr(task_module(n), "tool")]
        raise ConfigError(
            f"rollout.max_turns={cfg.rollout.max_turns}: task/{name}.py has no tool, so every "
            f"trajectory is one turn; tools' turns need a task with one ({', '.join(with_tool)})"
        )
    refuse_unread(cfg, READ_WHEN)
    # the files the functions are in, now; the functions when setup loads them
    if cfg.data.reward:
        check_function_spec(cfg.data.reward, "data.reward")
    for spec in cfg.rollout.tools:
        check_function_spec(spec, "rollout.tools")
    if hasattr(module, "check"):
        module.check(cfg)


def check_module(name, module):
    """A task module as the docstring above describes it, or a ConfigError naming what is
    missing or wrong: FIELDS (a set of task and tool fields), and `reward`, None or callable as
    a reward is (rewards.check_signature)."""
    where = f"data.task={name!r} (task/{name}.py)"
    if not callable(getattr(module, "prompts", None)):
        raise ConfigError(
            f"{where} is no task: it needs `prompts(cfg, tokenizer, split, seed, tool)`"
        )
    fields = getattr(module, "FIELDS", None)
    if not isinstance(fields, (set, frozenset)):
        raise ConfigError(
            f"{where} needs FIELDS, the set of config fields it reads beyond "
            f"{sorted(COMMON_FIELDS)} (set() for none)"
        )
    unknown = sorted(fields - TASK_FIELDS - TOOL_FIELDS)
    if unknown:
        raise ConfigError(
            f"{where}: FIELDS lists {unknown}, not task or tool fields; a setting a task needs "
            "is a field of config.DataConfig"
        )
    if not hasattr(module, "reward"):
        raise ConfigError(f"{where} needs `reward` (None: data.reward must name one)")
    if module.reward is not None:
        rewards.check_signature(module.reward, f"{where}: reward")


def vocabulary(cfg, base):
    """The tiny model's characters (model.path tiny): `base` (runtime/model.TINY_CHARS, the
    demo's), then each character the task's CHARS adds, in its order, so the demo's token ids
    never move."""
    extra = [c for c in getattr(task_module(cfg.data.task), "CHARS", "") if c not in base]
    return base + "".join(dict.fromkeys(extra))


@dataclasses.dataclass
class Task:
    """What a run trains on: its prompts, how a response is rewarded, and its tool."""

    train_prompts: list
    val_prompts: list
    reward_fn: object  # (response_text, answer, finished) -> float; see rewards.call_reward
    # the tool of multi-turn trajectories (rollout.max_turns > 1), else None
    tool: object


def build_task(cfg, tokenizer):
    """The `Task` that `data.task` names, its prompts tokenized with `tokenizer`. The reward
    data.reward names (loaded first: a wrong one is named before any data is read), else the
    task's own; validation uses the first data.num_val_prompts prompts of the "val" split."""
    d = cfg.data
    module = task_module(d.task)
    reward_fn = task_reward(d, module.reward)
    # one turn, or a task without one: no tool
    with_tool = cfg.rollout.max_turns > 1 and hasattr(module, "tool")
    tool = module.tool(cfg, tokenizer) if with_tool else None
    train_seed = seeds.derive(cfg.train.seed, "prompts", "train")
    val_seed = seeds.derive(cfg.train.seed, "prompts", "val")
    train = module.prompts(cfg, tokenizer, "train", train_seed, tool)
    val = module.prompts(cfg, tokenizer, "val", val_seed, tool)
    unknown = getattr(tokenizer, "unk_token_id", None)  # None: byte-level BPE (Qwen) knows all
    train = within_length(known(train, d, "train", unknown), d, "train")
    val = within_length(known(val, d, "val", unknown), d, "val")
    return Task(train, val[: d.num_val_prompts], reward_fn, tool)


def known(prompts, d, split, unknown_id):
    """The prompts without the tokenizer's unknown token (`unknown_id`; None: every prompt): the
    others counted and logged, and none left a DataError. The model could not read such a
    prompt; the tiny model's vocabulary is its base and the task's CHARS (`vocabulary`), so a
    character missing from CHARS, or a CHARS misspelt, would otherwise train on <unk>."""
    kept = [p for p in prompts if unknown_id is None or unknown_id not in p.prompt_ids]
    if len(kept) == len(prompts):
        return kept
    why = (
        f"data.task={d.task} {split}: {len(prompts) - len(kept)} of {len(prompts)} prompts hold "
        "characters the tokenizer does not know (the tiny model's: add them to the task's CHARS)"
    )
    if not kept:
        raise DataError(why)
    log.warning("%s: skipped", why)
    return kept


def within_length(prompts, d, split):
    """The prompts of at most data.max_prompt_len tokens, whatever the task (gsm8k and chat
    already skip longer rows as they read them); the others counted and logged, and none left a
    DataError."""
    kept = [p for p in prompts if len(p.prompt_ids) <= d.max_prompt_len]
    if len(kept) < len(prompts):
        log.warning(
            "data.task=%s %s: skipped %d prompts longer than data.max_prompt_len=%d tokens",
            d.task,
            split,
            len(prompts) - len(kept),
            d.max_prompt_len,
        )
    if not kept:
        raise DataError(
            f"data.task={d.task} {split}: every prompt is longer than "
            f"data.max_prompt_len={d.max_prompt_len} tokens"
        )
    return kept


def task_reward(d, default):
    """The reward `data.reward` names (every task honours it), else the task's own `default`."""
    return rewards.load_reward(d.reward) if d.reward else default


class PromptStream:
    """One rank's stream of training prompts: epochs of a seeded shuffle of the whole set, rank r
    reading every world_size-th prompt of it from r (ranks never share a prompt within an epoch).
    A step takes as many as it launches (with dynamic sampling, a varying number), so the
    stream's `position` (prompts this rank has read) is the data position: checkpoints store
    every rank's and `--resume` reads on."""

    def __init__(self, prompts, seed, rank=0, world_size=1, position=0):
        self.prompts = prompts
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = position  # prompts this rank has read
        self._epoch, self._order = None, None

    def take(self, count):
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.rank + self.world_size * self.position, len(self.prompts))
            if epoch != self._epoch:
                self._epoch, self._order = epoch, list(range(len(self.prompts)))
                random.Random(seeds.derive(self.seed, "stream", epoch)).shuffle(self._order)
            out.append(self.prompts[self._order[offset]])
            self.position += 1
        return out

    @classmethod
    def for_rank(cls, prompts, seed, rank, world_size, positions=None):
        """This rank's stream, at its position in a checkpoint's `positions` (one per rank that
        wrote it). The same world size reads on exactly. Another one cannot (the old ranks read
        unevenly under dynamic sampling): every rank starts past the furthest prompt any old rank
        read, so none is read twice in the epoch, and those a lagging rank had not reached wait
        for the next. No positions (a new run, or a checkpoint from before prompt streams): from
        the start."""
        if not positions:
            position = 0
        elif len(positions) == world_size:
            position = positions[rank]
        else:
            # old rank r's prompts were r, r + W, r + 2W, ... of the shuffled stream (`take`)
            old = len(positions)
            after = max((r + old * (p - 1) + 1 for r, p in enumerate(positions) if p), default=0)
            position = math.ceil(after / world_size)
        return cls(prompts, seed, rank, world_size, position)
