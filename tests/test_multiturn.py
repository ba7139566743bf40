"""Multi-turn tool rollouts on the real engine, and merged vs step-wise training sequences."""

import asyncio
import math

import torch

import update
import loss as losses
import merge
import sample
import extras.plot as plot
import task.tools as tools
import train
import rollout
import task.data as tasks
from assemble import load_config
from conftest import tiny_config


def tool_run(engine, tmp_path, *sets):
    return train.setup(
        tiny_config(
            tmp_path,
            "data.task=tiny_tool",
            "rollout.max_new_tokens=24",
            "rollout.max_turns=4",
            *sets,
        ),
        engine=engine,
    )


def test_tool_turns_extend_the_previous_context(engine, tmp_path):
    """A turn ending in "?" gets the calculator's answer as an observation, and the next turn's
    prompt is the previous context plus it (so turns merge); every turn carries the trajectory's
    reward, and a trajectory stays within its token budget."""
    run = tool_run(engine, tmp_path)
    samples, stats = rollout.generate_scored(run, run.stream.prompts[:16], 8, 1.0)
    trajectories = sample.trajectories_of(samples)
    multi = [t for t in trajectories if len(t) > 1]
    # random init ends a turn with "?" by chance
    assert multi and stats.num_tool_calls >= len(multi)
    for turns in multi:
        assert [t.turn for t in turns] == list(range(len(turns)))
        for before, after in zip(turns, turns[1:]):
            history = before.prompt_ids + before.response_ids
            assert after.prompt_ids[: len(history)] == history  # prefix: the turns merge
            observation = run.tokenizer.decode(after.prompt_ids[len(history) :])
            # the calculator's result
            assert observation == "=" + run.stream.prompts[before.group_id].answer
            assert before.response_ids[-1] == run.tool.call_end_id and before.tool_call == 1
        assert len({t.reward for t in turns}) == 1  # the trajectory's reward on every turn
        budget = 24 * 4
        assert (
            len(turns[-1].prompt_ids) + len(turns[-1].response_ids) - len(turns[0].prompt_ids)
            <= budget
        )


def test_merged_batch_has_the_same_token_mean_loss_as_step_wise(engine, tmp_path):
    """Real multi-turn rollouts trained merged are fewer, shorter sequences with the same trained
    tokens and the same token-mean loss as step-wise ones."""
    run = tool_run(engine, tmp_path)
    prompts = run.stream.prompts[:16]
    samples, _ = rollout.generate_scored(run, prompts, 8, 1.0)
    trajectories = sample.trajectories_of(samples)
    for turns, advantage in zip(trajectories, torch.randn(len(trajectories)).tolist()):
        for turn in turns:  # as advantages.compute writes it: every turn carries it
            turn.advantage = advantage
    merged, metrics = merge.training_sequences(trajectories, run.cfg, 256)
    run.cfg.rollout.merge_turns = False
    stepwise, _ = merge.training_sequences(trajectories, run.cfg, 256)
    merged_adv = torch.tensor([s.advantage for s in merged])
    stepwise_adv = torch.tensor([s.advantage for s in stepwise])
    assert metrics["merge/ratio"].value > 1 and len(merged) < len(stepwise)
    assert sum(len(s.prompt_ids) + len(s.response_ids) for s in merged) < sum(
        len(s.prompt_ids) + len(s.response_ids) for s in stepwise
    )

    def token_mean_loss(sequences, seq_advantages):
        batch = update.collate(sequences, pad_id=0)
        with torch.no_grad():
            logprobs, _ = update.sequence_logprobs(run.trainer.policy, batch, 1.0)
        old = logprobs - 0.1  # any fixed old policy: ratio exp(0.1) on every trained token
        loss, _ = losses.policy_loss(
            logprobs, old, seq_advantages, batch["loss_mask"], clip_eps=0.2
        )
        return loss.item(), batch["loss_mask"].sum().item()

    merged_loss, merged_tokens = token_mean_loss(merged, merged_adv)
    stepwise_loss, stepwise_tokens = token_mean_loss(stepwise, stepwise_adv)
    # observation tokens are masked, every response token trained once
    assert merged_tokens == stepwise_tokens
    assert math.isclose(merged_loss, stepwise_loss, rel_tol=1e-5, abs_tol=1e-7)


def test_a_call_with_no_turn_or_budget_left_is_a_truncation_not_an_answer(engine, tmp_path):
    """A tool call in the last allowed turn is never executed and ends the trajectory truncated
    ("length", reward 0); a call whose observation uses up the token budget ends it the same way,
    with no further turn started."""
    run = tool_run(engine, tmp_path, "rollout.max_turns=2")
    prompts = run.stream.prompts[:16]
    samples, stats = rollout.generate_scored(run, prompts, 8, 1.0)
    trajectories = sample.trajectories_of(samples)
    unanswered = [
        t for t in trajectories if t[-1].response_ids[-1:].tolist() == [run.tool.call_end_id]
    ]
    assert unanswered  # random init ends both turns with "?" in a few of 128 trajectories
    for turns in unanswered:
        assert len(turns) == 2 and turns[-1].finish_reason == "length" and turns[-1].tool_call == 0
        assert turns[-1].reward == 0.0  # never executed, never scored as an answer
    # only executed calls count
    assert stats.num_tool_calls == sum(t.tool_call != 0 for t in samples)
    # budget: "?" (1 token) + observation "=4" (2) fills max_response_tokens=3, so the call is never
    # answered
    run.cfg.rollout.max_new_tokens, run.cfg.rollout.max_response_tokens = 1, 3
    samples, stats = rollout.generate_scored(run, run.stream.prompts[:64], 8, 1.0)
    called = [s for s in samples if s.tool_call == 1]
    assert called and all(s.finish_reason == "length" and s.turn == 0 for s in called)
    assert len(samples) == 64 * 8  # no second turn was started


def test_the_tool_demo_config_trains_and_logs_tool_use(engine, tmp_path):
    """configs/tiny_tool.yaml as shipped (fewer steps and prompts) trains with tool calls and
    merged turns, logs the tool metrics and plot.py draws them; max_turns=1 turns the tool off."""
    from test_train import scalars

    cfg = load_config(
        "configs/tiny_tool.yaml",
        [
            f"run.out={tmp_path}",
            "train.steps=2",
            "run.val_every=1",
            "data.num_val_prompts=16",
            "rollout.prompts_per_step=16",
        ],
    )
    run = train.setup(cfg, engine=engine)
    assert isinstance(run.tool, tools.QuestionCalculator)
    train.train(run)
    logged = scalars(tmp_path)
    # one-token turns: "?" ~1 in 25
    assert max(logged["rollout/tool_calls"]) > 0 and max(logged["merge/ratio"]) > 1
    # counted per tool too: the demo has one
    assert logged["tools/calculator/calls"] == logged["rollout/tool_calls"]
    assert (
        all(0 <= v <= 1 for v in logged["val/tool_call_ratio"])
        and len(logged["val/tool_call_ratio"]) == 3
    )
    assert all(math.isfinite(v) for v in logged["train/loss"])
    drawn = plot.plot(str(tmp_path), str(tmp_path / "curves.png"))  # the README's tool demo picture
    assert {
        "rollout/tool_calls_per_trajectory",
        "val/tool_call_ratio",
        "merge/ratio",
        "val/reward_mean",
    } <= set(drawn)
    no_tool = load_config(
        "configs/tiny_tool.yaml",
        [f"run.out={tmp_path}", "rollout.max_turns=1", "rollout.max_response_tokens=0"],
    )
    # the switch the README gives turns the tool off
    assert tasks.build_task(no_tool, run.tokenizer).tool is None


class SlowCalculator(tools.QuestionCalculator):
    """The tool demo's calculator, answering after `seconds` (a slow tool: a sandbox, a search)."""

    def __init__(self, tokenizer, seconds):
        super().__init__(tokenizer)
        self.seconds = seconds
        self.started = self.finished = 0  # calls

    async def __call__(self, response_ids, prompt_ids=()):
        self.started += 1
        await asyncio.sleep(self.seconds)
        self.finished += 1
        return await super().__call__(response_ids, prompt_ids)


def test_a_cancellation_does_not_wait_for_a_running_tool(engine, tmp_path):
    """A trajectory whose tool is still running has nothing in the engine to abort: the cancel
    decision's aborts return without waiting for the 10 s tool, the cancelled trajectory starts
    no turn after it, and the rollout ends without waiting for the tool either (its result would
    be thrown away: the call is cancelled; the rollout waited it out before)."""
    from cancel import plan_launch

    run = tool_run(engine, tmp_path, "rollout.cancel=count", "rollout.drop_rate=0.5")
    slow = SlowCalculator(run.tokenizer, seconds=10.0)
    plan = plan_launch(run.cfg.rollout, 16)
    samples, stats = engine.generate(
        [p.prompt_ids for p in run.stream.prompts[:16]],
        8,
        1.0,
        24,
        plan,
        tool=slow,
        max_turns=4,
    )
    trajectories = sample.trajectories_of(samples)
    assert stats.num_cancelled > 0
    # random init ends a turn with "?" by chance: the calls land in the cancelled tail; one
    # cancelled while its tool ran ends in that turn (no turn started after), masked
    in_tool = [
        t
        for t in trajectories
        if t[-1].response_ids[-1:].tolist() == [slow.call_end_id] and t[-1].finish_reason == "abort"
    ]
    assert in_tool and all(turn.masked for t in in_tool for turn in t)
    assert slow.started > slow.finished  # a tool was running at the decision, and was cancelled
    assert stats.cancel_latency_s < 1.0, stats  # not the tool's 10 s
    assert stats.rollout_s - stats.decision_s < 5.0, stats  # nor at the rollout's end
    assert engine.num_in_flight() == 0


def test_a_task_tools_own_cancellation_is_a_rollout_error_and_an_abort_is_none():
    """`Rollout.run_tool` on its own (no engine: nothing of the trajectory is in it while its
    tool runs). A task's own tool (not QwenTools, which answers errors) raising CancelledError
    is a RolloutError naming it: as a cancellation it would end the whole rollout with no
    checkpoint. An abort while the tool runs (`abort` sets the trajectory's Event) returns
    None, the tool's call cancelled; the trajectory stays in its tool until the tool has
    stopped, then leaves it."""
    import types

    import pytest

    import inflight
    from runtime.engine import RolloutError

    class Tool:
        names = ["calculator"]

        def __init__(self, behaviour):
            self.behaviour, self.cancelled = behaviour, False

        async def __call__(self, response_ids, prompt_ids=()):
            if self.behaviour == "cancels itself":
                raise asyncio.CancelledError()
            if self.behaviour == "answers":
                return tools.Observation([1, 2], "calculator", False, True)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled = True
                await asyncio.sleep(0.2)  # slow to stop (a client closing its connection)
                raise

    def rollout_with(tool):
        settings = inflight.Settings(sampling={}, group_size=1, budget=8, tool=tool)
        return inflight.Rollout(types.SimpleNamespace(cfg=None), settings, None)

    request = inflight.Request(index=3, group_id=0, prompt_ids=[5])
    turn = types.SimpleNamespace(response_ids=[7])
    own = rollout_with(Tool("cancels itself"))
    with pytest.raises(RolloutError, match="the task's tool Tool was cancelled"):
        asyncio.run(own.run_tool(request, turn))
    assert own.in_tool == {}

    answers = rollout_with(Tool("answers"))
    observation = asyncio.run(answers.run_tool(request, turn))
    assert observation.ids == [1, 2] and answers.stats.tool_calls == {"calculator": 1}

    hangs = rollout_with(Tool("hangs"))

    async def aborted():
        calling = asyncio.ensure_future(hangs.run_tool(request, turn))
        await asyncio.sleep(0.05)
        hangs.in_tool[request.index].set()  # what `abort` does at the decision
        await asyncio.sleep(0.1)
        # until its tool has stopped, the trajectory is in it (an abort then has nothing of its
        # in the engine to wait for)
        stopping = request.index in hangs.in_tool and hangs.settings.tool.cancelled
        return await asyncio.wait_for(calling, 5), stopping

    assert asyncio.run(aborted()) == (None, True)
    assert hangs.settings.tool.cancelled and hangs.in_tool == {}
    assert hangs.stats.num_tool_calls == 0
