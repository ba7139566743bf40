"""A shared prompt (train.shared_prefix, update.py): the samples of a GRPO group packed side by
side compute their prompt once, each response reading it through the attention mask. The same
log-probs, entropies and updates as packing each sample whole, in every loss mode; the mask has
teeth; FlexAttention's block mask is create_block_mask's. CPU, fp32, no engine (the countdown run
in tests/test_own_task.py trains with it on the real engine, routes replayed)."""

import functools
import random

import pytest
import torch

import dist_worker
import loss as losses
import runtime.model as model
import update
from config import ConfigError
from sample import Sample
from test_packing import advantages_of, assert_same_blocks


def grouped_samples(seed, prompt_lengths=(5, 1, 9, 3, 2), group_size=4, response=(1, 20)):
    """GRPO groups: each of `group_size` samples answering one prompt of each length (a 1-token
    prompt among them: nothing to share), responses of random lengths, one sample in three
    aborted, some tokens sampled a version or two ago; and their group advantages."""
    rng = random.Random(seed)
    samples = []
    for group, length in enumerate(prompt_lengths):
        prompt = [rng.randint(4, 24) for _ in range(length)]
        for _ in range(group_size):
            n = rng.randint(*response)
            aborted = len(samples) % 3 == 2
            samples.append(
                Sample(
                    prompt,
                    [rng.randint(4, 24) for _ in range(n)],
                    [-rng.random() * 3 for _ in range(n)],
                    [1] * n,
                    group_id=group,
                    trajectory_id=len(samples),
                    masked=aborted,
                    finish_reason="abort" if aborted else "stop",
                    versions=[-rng.randint(0, 2) for _ in range(n)],
                )
            )
    return samples, advantages_of(samples, seed)


def saved_positions(samples):
    """What sharing saves: per group of G samples with a prompt of L > 1 tokens, (G - 1)(L - 1)."""
    groups = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(len(s.prompt_ids))
    return sum((len(ls) - 1) * (ls[0] - 1) for ls in groups.values())


@pytest.mark.parametrize("attention", model.ATTENTION)
def test_shared_prompt_scores_every_token_as_packed_whole(tmp_path, attention, monkeypatch):
    """With the prompt shared, every response token gets the log-prob and entropy it gets packed
    whole, under each attention implementation (FlexAttention: forward only, CPU; its gradients
    are checked on a GPU, bench/train_step.py --shape `parity`), on (G - 1)(L - 1) positions
    fewer per group. Without the batch's own mask (transformers reading position_ids) the
    responses would read each other: the log-probs move by far more."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    policy, _ = model.build_policy(dist_worker.parity_config(tmp_path, "token-mean"), None)
    samples, _ = grouped_samples(0)
    units = update.prefix_units(samples, 10_000)
    assert units == [list(range(g * 4, g * 4 + 4)) for g in range(5)]  # a unit per group
    order = [i for unit in units for i in unit]
    rows = [len(order)]  # one row: every group's unit, side by side
    whole = update.collate([samples[i] for i in order], 0, rows)
    shared = update.collate([samples[i] for i in order], 0, rows, shared_prefix=True)
    real = lambda batch: int(batch["shared_prefix_tokens"])  # noqa: E731
    assert (real(whole), real(shared)) == (0, saved_positions(samples)) and real(shared) == 45
    assert shared["packed_ids"].shape[1] == whole["packed_ids"].shape[1] - 45
    assert torch.equal(shared["gathered"], whole["gathered"])
    # every segment keeps its tokens' positions in the whole sequence
    assert shared["position_ids"].max() == whole["position_ids"].max()
    # with the switch on, a micro-batch with nothing to share keeps the same mask function
    alone = update.collate([samples[0]], 0, [1], shared_prefix=True)
    assert (alone["prefix_of"] == -1).all() and "prefix_of" not in whole
    with torch.no_grad():
        expected, expected_entropy = update.sequence_logprobs(policy, whole, 1.0)
        policy.set_attn_implementation(attention)
        got, entropy = update.sequence_logprobs(policy, shared, 1.0)
        policy.set_attn_implementation("sdpa")
        blind = {
            k: v for k, v in shared.items() if k not in ("documents", "prefix_of", "block_mask")
        }
        leaked, _ = update.sequence_logprobs(policy, blind, 1.0)
    mask = whole["gathered"]
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], atol=1e-5, rtol=0)
    assert (got[~mask] == 0).all()
    assert (leaked[mask] - expected[mask]).abs().max() > 1e-2


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_one_update_with_the_prompt_shared_equals_it_packed_whole(tmp_path, mode):
    """All four loss modes, aborted samples, TIS on and stale tokens, a budget that cuts a group
    in two units (each computes the prompt) and leaves one sequence over it: the same loss,
    gradients and parameters after one update as packing each sample whole, the same tokens
    trained, fewer positions computed (train/shared_prefix_tokens counts them)."""
    samples, advantages = grouped_samples(1, prompt_lengths=(6, 1, 12), response=(1, 24))
    samples[9] = Sample(samples[9].prompt_ids, [7] * 40, [-1.0] * 40, [1] * 40, group_id=2)
    budget = 45
    results = []
    for shared in ("false", "true"):
        cfg = dist_worker.parity_config(
            tmp_path,
            mode,
            "train.tis_cap=2",
            f"train.max_tokens_per_micro_batch={budget}",
            f"train.shared_prefix={shared}",
        )
        results.append(dist_worker.update_once(cfg, samples, advantages, shard=False)[::2])
    (whole, whole_stats), (shared, shared_stats) = results
    assert "train/shared_prefix_tokens" not in whole_stats
    saved = shared_stats["train/shared_prefix_tokens"]
    assert 0 < saved < saved_positions(samples)  # a group cut in two computes its prompt twice
    assert (
        shared_stats["train/over_budget_sequences"]
        == whole_stats["train/over_budget_sequences"]
        == 1
    )
    assert shared_stats["train/tokens"] == whole_stats["train/tokens"]
    assert 0 <= shared_stats["train/padded_fraction"] < 1
    assert shared_stats["train/loss"] == pytest.approx(whole_stats["train/loss"], abs=1e-6)
    for (name, a), (_, b) in zip(whole.named_parameters(), shared.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-7, rtol=1e-4, msg=name)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)


def test_prefix_units_keep_groups_whole_under_the_budget():
    """A group is one unit while the prompt once plus every response (and the prompt's last
    token each) fits the budget, else cut where the next sample would pass it; a sample over the
    budget alone is a unit of its own. Groups come in the order they first appear."""
    prompt, other = [1, 2, 3, 4], [5, 6]
    make = lambda p, n, g: Sample(p, [9] * n, [0.0] * n, [1] * n, group_id=g)  # noqa: E731
    samples = [make(prompt, 6, 0), make(other, 3, 1), make(prompt, 5, 0), make(prompt, 30, 0)]
    samples += [make(prompt, 2, 0), make(other, 1, 1)]
    # prompt's group: 4 + 6 = 10, + 6 = 16, then 31 more would pass 20: cut; 34 alone; then 4 + 2
    assert update.prefix_units(samples, 20) == [[0, 2], [3], [4], [1, 5]]
    assert update.prefix_units(samples, 100) == [[0, 2, 3, 4], [1, 5]]


def test_a_shared_prompt_is_refused_where_nothing_would_share_it(tmp_path, monkeypatch):
    """Padded micro-batches (one sample a row) would never read train.shared_prefix: refused at
    load, by name. A model with a sliding window is refused before the engine starts: its
    segments sit farther from their prompt than their positions say. SDPA is refused on a GPU
    (only the device is named here: nothing is allocated), where its dense mask over rows as wide
    as the budget would cost width^2; FlexAttention there, and SDPA on CPU, pass."""
    with pytest.raises(ConfigError, match="train.shared_prefix=True is read only with packed"):
        dist_worker.parity_config(
            tmp_path,
            "token-mean",
            "train.max_tokens_per_micro_batch=0",
            "train.shared_prefix=true",
        )
    cfg = dist_worker.parity_config(
        tmp_path, "token-mean", "train.max_tokens_per_micro_batch=64", "train.shared_prefix=true"
    )
    import transformers

    config = transformers.MistralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
    )
    mistral = transformers.MistralForCausalLM(config)
    with pytest.raises(model.ModelError, match=r"window or chunk \(8\).*shared_prefix=false"):
        model.check_family(cfg, mistral)
    model.check_attention(cfg, torch.device("cpu"))
    with pytest.raises(model.ModelError, match="on a GPU set model.attn_implementation=flex"):
        model.check_attention(cfg, torch.device("cuda"))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # what flex raises, undone
    cfg.model.attn_implementation = "flex_attention"
    model.check_attention(cfg, torch.device("cuda"))


def shared_positions(prompt_lengths, response_lengths, rows=None, seed=0):
    """Packed rows' position_ids, documents and prefix_of, as collate lays out groups of these
    prompt lengths, with a response of each length in turn, `rows` samples a row (default: one
    row): long prompts whose shared blocks are whole (full blocks), short ones, 1-token prompts
    (nothing shared), a group cut by a row's end (its prompt again in the next row)."""
    rng = random.Random(seed)
    samples = []
    for group, length in enumerate(prompt_lengths):
        prompt = [rng.randint(4, 24) for _ in range(length)]
        for n in response_lengths[group]:
            samples.append(Sample(prompt, [5] * n, [0.0] * n, [1] * n, group_id=group))
    batch = update.collate(samples, 0, rows or [len(samples)], shared_prefix=True)
    return batch["position_ids"], batch["documents"], batch["prefix_of"]


@pytest.mark.parametrize(
    "prompt_lengths, response_lengths, rows",
    [
        ((300, 5), ([40, 300, 1, 128], [7, 7]), None),
        ((2, 257, 1, 129), ([1, 2], [500, 3, 260], [10, 4], [127, 128, 129]), None),
        ((2, 257, 1, 129), ([1, 2], [500, 3, 260], [10, 4], [127, 128, 129]), [3, 4, 3]),
    ],
)
def test_the_shared_prompt_block_mask_is_create_block_masks(prompt_lengths, response_lengths, rows):
    """update.document_mask with a shared prompt, from each block's id ranges, is the BlockMask
    create_block_mask makes from every token pair: the same partial and full blocks on both
    sides, full ones where whole key blocks of a prompt meet whole query blocks reading only it;
    and FlexAttention (forward, CPU) gives the same output under both."""
    from torch.nn.attention.flex_attention import create_block_mask

    position_ids, documents, prefix_of = shared_positions(prompt_lengths, response_lengths, rows)
    batch_size, width = position_ids.shape
    mask_mod = update.causal_in_document(documents, None, prefix_of)
    expected = create_block_mask(mask_mod, batch_size, None, width, width, device="cpu")
    got = update.document_mask(position_ids, None, documents, prefix_of)
    assert_same_blocks(got, expected)
    assert int(got.full_kv_num_blocks.sum()) > 0
