"""Padding-free training (update.py): token-budget micro-batches of packed rows give the same
log-probs, entropies and updates as the padded path, in every loss mode, and sequences packed
together never see each other (a leak would not raise: it is tested for). CPU, fp32, no engine."""

import array
import functools
import os
import random
import re
import runpy
import sys
import warnings

import pytest
import torch
from advantages import group_advantages

import update
import dist_worker
import loss as losses
import runtime.model as model
import assemble as setup_run
from metrics import local_values
from sample import NOT_GENERATED, Sample


def random_samples(seed, lengths=None):
    """Samples of mixed lengths (a 1-token response among them), a third aborted, some tokens
    sampled one or two weight versions ago (partial rollout's stale tokens)."""
    rng = random.Random(seed)
    lengths = lengths or [(rng.randint(2, 8), rng.randint(1, 30)) for _ in range(11)] + [(3, 1)]
    samples = []
    for i, (num_prompt, num_response) in enumerate(lengths):
        aborted = i % 3 == 2
        samples.append(
            Sample(
                [rng.randint(4, 24) for _ in range(num_prompt)],
                [rng.randint(4, 24) for _ in range(num_response)],
                [-rng.random() * 3 for _ in range(num_response)],
                [1] * num_response,
                group_id=i // 4,
                trajectory_id=i,
                masked=aborted,
                finish_reason="abort" if aborted else "stop",
                versions=[-rng.randint(0, 2) for _ in range(num_response)],
            )
        )
    return samples, advantages_of(samples, seed)


def advantages_of(samples, seed):
    """GRPO advantages of seeded random rewards, the masked samples left out."""
    advantages, _ = group_advantages(
        torch.randn(len(samples), generator=torch.Generator().manual_seed(seed)),
        torch.tensor([s.group_id for s in samples]),
        torch.tensor([not s.masked for s in samples]),
    )
    return advantages


def test_pack_rows_fills_rows_first_fit_decreasing_under_the_budget():
    """pack_rows places every sequence once: one over the budget in a micro-batch of its own, the
    rest first-fit decreasing into rows as wide as the longest sequence under the budget, as many
    rows per micro-batch as the budget holds."""
    lengths = [50, 7, 30, 12, 64, 9, 3, 150, 21, 40]
    layout = update.pack_rows(lengths, max_tokens=128)
    assert sorted(i for mb in layout for row in mb for i in row) == list(range(len(lengths)))
    assert layout[0] == [[7]]  # 150 tokens, over the budget: a micro-batch of its own
    # rows 64 wide (the longest sequence under the budget), each sequence, longest first, into the
    # first row with room: 64 | 50+12 | 40+21+3 | 30+9+7; two rows (128 positions) per micro-batch
    assert layout[1:] == [[[4], [0, 3]], [[9, 8, 6], [2, 5, 1]]]


def packed(samples, max_tokens=10_000):
    """One micro-batch of `samples` packed as `pack_rows` lays them out (the budget holds them
    all)."""
    (layout,) = update.pack_rows(
        [len(s.prompt_ids) + len(s.response_ids) for s in samples], max_tokens
    )
    return (
        update.collate(
            [samples[i] for row in layout for i in row], 0, [len(row) for row in layout]
        ),
        layout,
    )


@pytest.mark.parametrize("attention", model.ATTENTION)
def test_packed_logprobs_equal_padded_per_token(tmp_path, attention, monkeypatch):
    """Packed rows, under each attention implementation, give the padded path's log-probs and
    entropies (sdpa, today's reference) at every position that predicts a response token (0
    elsewhere), with less padding and the head run on response positions only. FlexAttention runs
    forward only on CPU (no backward there): its gradients are checked on a GPU alone
    (bench/train_step.py --shape, `parity`)."""
    # traced, not compiled to C++: the mask is what is tested (a GPU runs Triton's kernel, not the
    # CPU's), and inductor's CPU build of FlexAttention takes ~20 s
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = dist_worker.parity_config(tmp_path, "token-mean")
    policy, _ = model.build_policy(cfg, None)
    samples, _ = random_samples(0)
    batch, layout = packed(samples)
    padded = update.collate([samples[i] for row in layout for i in row], pad_id=0)
    # rows no wider than the longest
    assert batch["packed_ids"].shape[1] == padded["input_ids"].shape[1]
    # less padding (only at row ends)
    assert batch["packed_ids"].numel() < padded["input_ids"].numel()
    # the head: responses only
    assert len(batch["head_index"]) == sum(len(s.response_ids) for s in samples)
    built = []  # BlockMasks made: one per packed micro-batch, kept for its later forwards
    make = update.document_mask
    monkeypatch.setattr(update, "document_mask", lambda ids: built.append(ids) or make(ids))
    with torch.no_grad():
        expected, expected_entropy = update.sequence_logprobs(policy, padded, 1.0)
        policy.set_attn_implementation(attention)
        assert policy.model.layers[0].self_attn.config._attn_implementation == attention
        got, entropy = update.sequence_logprobs(policy, batch, 1.0)
        again, _ = update.sequence_logprobs(policy, batch, 1.0)
    assert len(built) == (attention == "flex_attention") and torch.equal(again, got)
    real = batch["gathered"]  # every position that predicts a response token
    assert real.sum() == len(batch["head_index"])
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[real], expected_entropy[real], atol=1e-5, rtol=0)
    assert (got[~real] == 0).all()


def test_the_packed_head_skips_tool_observations(tmp_path):
    """A merged multi-turn sequence's tool observations (loss_mask 0) are in the model's input
    but no loss or statistic reads their predictions: the packed head runs only where the sample
    trains (a reviewer counted 24 of 72 head positions on observations), with the padded path's
    log-probs there, shared prompt or not."""
    cfg = dist_worker.parity_config(tmp_path, "token-mean")
    policy, _ = model.build_policy(cfg, None)
    samples, _ = random_samples(1)
    for k, s in enumerate(samples):  # every other sample: turns merged around an observation
        if k % 2 and len(s.response_ids) > 4:
            s.loss_mask[1:3] = array.array("B", [0, 0])
            s.versions[1:3] = array.array("i", [NOT_GENERATED] * 2)
    trained = sum(sum(s.loss_mask) for s in samples)
    assert trained < sum(len(s.response_ids) for s in samples)
    _, layout = packed(samples)
    ordered = [samples[i] for row in layout for i in row]
    padded = update.collate(ordered, pad_id=0)
    reads = padded["loss_mask"] > 0  # (an aborted sample's row is all zero)
    with torch.no_grad():
        expected, _ = update.sequence_logprobs(policy, padded, 1.0)
        for shared_prefix in (False, True):
            rows = [len(row) for row in layout]
            batch = update.collate(ordered, 0, rows, shared_prefix=shared_prefix)
            assert len(batch["head_index"]) == trained
            got, _ = update.sequence_logprobs(policy, batch, 1.0)
            torch.testing.assert_close(got[reads], expected[reads], atol=1e-5, rtol=0)


def packed_positions(seed, rows, width):
    """position_ids of `rows` packed rows: sequences of 1 to 300 tokens (within, across and
    filling 128-token blocks), odd rows ending in padding (position 0 repeated)."""
    rng = random.Random(seed)
    position_ids = torch.zeros(rows, width, dtype=torch.long)
    for row in range(rows):
        start = 0
        while start < width - (row % 2) * 40:  # odd rows: 40 pad tokens at the end
            # row 0 opens with 300 tokens: two whole blocks of one sequence (a full block)
            n = 300 if row == start == 0 else rng.choice([1, 5, 60, 127, 128, 129, 256, 300])
            n = min(n, width - start)
            position_ids[row, start : start + n] = torch.arange(n)
            start += n
    return position_ids


def assert_same_blocks(got, expected):
    """Two BlockMasks allow the same partial and full blocks, on the key and the query side, in
    the same order, and FlexAttention (forward, CPU) gives the same output under both."""
    from torch.nn.attention.flex_attention import flex_attention

    batch_size, _, width, _ = got.shape
    for side in ("kv", "full_kv", "q", "full_q"):
        counts = getattr(got, f"{side}_num_blocks")
        assert torch.equal(counts, getattr(expected, f"{side}_num_blocks").to(counts.dtype)), side
        for index in torch.cartesian_prod(*[torch.arange(n) for n in counts.shape]):
            n, at = int(counts[tuple(index)]), tuple(index)
            want = getattr(expected, f"{side}_indices")[at][:n]
            assert torch.equal(getattr(got, f"{side}_indices")[at][:n], want.to(torch.int32))
    x = torch.randn(batch_size, 2, width, 16, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():  # eager FlexAttention on CPU says to compile it: a reference
        warnings.simplefilter("ignore")
        torch.testing.assert_close(
            flex_attention(x, x, x, block_mask=got),
            flex_attention(x, x, x, block_mask=expected),
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize(
    "rows, width, window",
    [(1, 77, None), (2, 128, None), (3, 300, None), (2, 1024, None), (4, 1000, None)]
    + [(3, 300, 300), (2, 1024, 300), (4, 1000, 130), (1, 700, 130)],
)
def test_the_document_mask_is_create_block_masks_block_for_block(rows, width, window):
    """update.document_mask, built from each block's first and last sequence, is the BlockMask
    torch's create_block_mask makes by evaluating every token pair: the same partial and full
    blocks on the key and the query side, in the same order; and FlexAttention (forward, CPU)
    gives the same output under both. With a sliding window too (Gemma 3's layers): 300 tokens
    (a key block one back can be full), 130 (over one 700-token sequence: key blocks 3 back and
    beyond left out, none full)."""
    from torch.nn.attention.flex_attention import create_block_mask

    position_ids = packed_positions(width, rows, width)
    if window == 130 and rows == 1:  # one sequence of every position: blocks 3 back left out
        position_ids = torch.arange(width).unsqueeze(0)
    mask_mod = update.causal_in_document(update.document_ids(position_ids), window)
    expected = create_block_mask(mask_mod, rows, None, width, width, device="cpu")
    got = update.document_mask(position_ids, window)
    if window == 130 and rows == 1 and width > 3 * 128:
        assert int(got.kv_num_blocks.max()) == 3 and int(got.full_kv_num_blocks.sum()) == 0
    assert got.seq_lengths == expected.seq_lengths == (width, width)
    assert_same_blocks(got, expected)
    assert int(got.full_kv_num_blocks.sum()) > 0 or width < 256 or window == 130  # full ones


def test_the_block_mask_bench_checks_both_masks_and_times_them():
    """bench/block_mask.py, small: it builds the mask both ways on packed GSM8K-like rows, finds
    them equal block for block, and prints both times and their ratio."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "block_mask.py")
    bench = runpy.run_path(path, run_name="bench_block_mask")  # not "__main__": nothing runs yet
    line = bench["main"](["--widths", "300,1000", "--repeats", "1"])
    assert re.fullmatch(
        r"block_mask: device=cpu width=1000 dense_s=[\d.]+ blocks_s=[\d.]+ speedup=[\d.]+", line
    ), line


@pytest.mark.parametrize("minibatches, forwards", [(1, 1), (2, 2)])
def test_every_forward_of_a_micro_batch_reads_the_same_dict(
    tmp_path, monkeypatch, minibatches, forwards
):
    """pi_old's forward and the update's read each packed micro-batch from one dict, so the
    BlockMask update.packed_mask keeps there is built once per micro-batch, not per forward. With
    one minibatch pi_old is the update's own forward (update.pi_old_source): one forward each."""
    cfg = dist_worker.parity_config(
        tmp_path,
        "token-mean",
        "train.max_tokens_per_micro_batch=30",
        f"train.num_minibatches={minibatches}",
    )
    policy, _ = model.build_policy(cfg, None)
    trainer = setup_run.trainer_only(cfg, policy)
    samples, advantages = random_samples(2)
    for s, advantage in zip(samples, advantages.tolist()):
        s.advantage = advantage
    read = []
    forward = update.sequence_logprobs
    monkeypatch.setattr(
        update,
        "sequence_logprobs",
        lambda m, batch, *a, **k: read.append(id(batch)) or forward(m, batch, *a, **k),
    )
    stats = local_values(update.update_policy(trainer, samples, step=0))
    assert stats["train/micro_batches"] == len(set(read)) > 1
    assert all(read.count(batch) == forwards for batch in set(read))  # pi_old, then the update


def test_flex_attention_is_refused_for_training_on_cpu(tmp_path, monkeypatch):
    """FlexAttention cannot train on CPU (torch raises in the backward, after a whole forward):
    the trainer says so before the first step, and how to fix it. On a GPU it raises Dynamo's
    recompile limit (the line a CPU can run of that branch)."""
    cfg = dist_worker.parity_config(
        tmp_path, "token-mean", "model.attn_implementation=flex_attention"
    )
    policy, _ = model.build_policy(cfg, None)
    assert policy.config._attn_implementation == "flex_attention"
    with pytest.raises(model.ModelError, match="model.attn_implementation=sdpa"):
        setup_run.trainer_only(cfg, policy)
    # on a GPU (only the device is named here: nothing is allocated) Dynamo's recompile limit is
    # raised so the compiled kernel never falls back to the unfused path
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    model.check_attention(cfg, torch.device("cuda"))
    assert torch._dynamo.config.recompile_limit == 32
    # so does train.compile, under any attention: its head is one function for the policy and the
    # frozen reference, a variant per grad mode and head-position count (a reviewer hit 8)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    compiled = dist_worker.parity_config(tmp_path, "token-mean", "train.compile=true")
    model.check_attention(compiled, torch.device("cpu"))
    assert torch._dynamo.config.recompile_limit == 32


def test_a_filler_micro_batch_has_the_shapes_of_a_real_one(monkeypatch):
    """A rank short of micro-batches runs fillers (FSDP2 gathers in every forward). A reviewer found
    the filler was one row of 2 positions with 1 head position: sizes Dynamo specialises on, and a
    row of one document (transformers then passes no mask), so a compiled layer and head compiled
    again after warm-up on every multi-rank run that needed one. It now has 2 rows of 2 documents
    and 4 head positions, and trains nothing."""
    samples = [Sample([1, 5, 12], [4] * n, [0.0] * n, [1] * n, group_id=0) for n in (3, 9, 5)]
    real = update.parallel.all_reduce
    monkeypatch.setattr(  # another rank needs one micro-batch more
        update.parallel,
        "all_reduce",
        lambda values, op="sum": (
            [v + 1 for v in real(values, op)] if op == "max" else real(values, op)
        ),
    )
    out, _ = update.micro_batches(samples, 4, 0, max_tokens=32)
    filler = out[-1]
    assert "filler" in filler and not any("filler" in mb for mb in out[:-1])
    rows, width = filler["packed_ids"].shape
    assert rows == 2 and width >= 2 and len(filler["head_index"]) >= 2
    starts = (filler["position_ids"] == 0).sum(-1)  # documents per row
    assert starts.tolist() == [2, 2] and filler["loss_mask"].sum() == 0
    # padded: as many rows as a real micro-batch, up to 2 (a size-1 run's filler stays 1 row)
    for size, rows in ((1, 1), (4, 2)):
        out, _ = update.micro_batches(samples, size, 0)
        assert "filler" in out[-1] and out[-1]["input_ids"].shape[0] == rows


def test_sequences_packed_together_do_not_attend_to_each_other(tmp_path):
    """The check above has teeth: with an attention mask passed, or a cache built (use_cache left
    on), the same packed row gives its second sequence other log-probs (it attends to the first).
    transformers builds the block-diagonal mask only without either (masking_utils.py,
    find_packed_sequence_indices)."""
    policy, _ = model.build_policy(dist_worker.parity_config(tmp_path, "token-mean"), None)
    samples, _ = random_samples(1, lengths=[(6, 40), (4, 12), (3, 20)])  # 46, 16, 23 tokens
    batch, layout = packed(samples)
    assert layout == [[0], [2, 1]]  # rows 46 wide: the longest alone, then 23 + 16
    first, second = len(samples[2].prompt_ids) + len(samples[2].response_ids), samples[1]
    n = len(second.prompt_ids) + len(second.response_ids)
    assert (
        batch["packed_ids"][1, first : first + n].tolist()
        == (second.prompt_ids + second.response_ids).tolist()
    )
    response = slice(len(second.prompt_ids) - 1, n - 1)
    with torch.no_grad():
        # sample 1 is third in the batch
        got = update.sequence_logprobs(policy, batch, 1.0)[0][2, response]
        alone = update.sequence_logprobs(policy, update.collate([second], pad_id=0), 1.0)[0][
            0, response
        ]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
        row, positions = (
            batch["packed_ids"][1:, : first + n],
            batch["position_ids"][1:, : first + n],
        )
        for careless in (
            dict(attention_mask=torch.ones_like(row), use_cache=False),
            dict(attention_mask=None, use_cache=True),
        ):
            logits = policy(input_ids=row, position_ids=positions, **careless).logits
            leaked = losses.token_logprobs(logits[:, first:-1], row[:, first + 1 :])[0][0][response]
            assert (leaked - alone).abs().max() > 1e-3, careless  # the leak shows


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_one_update_packed_equals_padded(tmp_path, mode):
    """All four loss modes, with aborted rows, truncated importance sampling on and stale tokens
    (a token budget that splits the batch unevenly, some sequences over it): the same parameters
    after one update."""
    samples, advantages = random_samples(2)
    budget = 30
    assert max(len(s.prompt_ids) + len(s.response_ids) for s in samples) > budget
    results = []
    # (tiny.yaml packs by default: 0 is the padded layout)
    for extra in (
        ["train.max_tokens_per_micro_batch=0"],
        [f"train.max_tokens_per_micro_batch={budget}"],
    ):
        cfg = dist_worker.parity_config(tmp_path, mode, "train.tis_cap=2", *extra)
        policy, _, stats = dist_worker.update_once(cfg, samples, advantages, shard=False)
        results.append((policy, stats))
    (padded, padded_stats), (packed, packed_stats) = results
    assert packed_stats["train/padded_fraction"] < padded_stats["train/padded_fraction"]
    over = sum(len(s.prompt_ids) + len(s.response_ids) > budget for s in samples)
    assert (
        packed_stats["train/over_budget_sequences"] == over
        and packed_stats["train/tokens"] == padded_stats["train/tokens"]
    )
    assert packed_stats["train/stale_token_frac"] == padded_stats["train/stale_token_frac"] > 0
    assert packed_stats["train/loss"] == pytest.approx(padded_stats["train/loss"], abs=1e-6)
    for (name, a), (_, b) in zip(padded.named_parameters(), packed.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-7, rtol=1e-4, msg=name)
        # AdamW's first step is about lr x sign(grad): where a gradient is at rounding level (the
        # two layouts' attention kernels round apart) its sign, so the step, may flip
        clear = a.grad.abs() > 1e-5
        torch.testing.assert_close(b[clear], a[clear], atol=1e-5, rtol=0, msg=name)


@pytest.mark.background(
    "train_step_bench",
    [
        sys.executable,
        "bench/train_step.py",
        "--repeats",
        "1",
        "--demo-prompts",
        "8",
        "--gsm8k-samples",
        "2",
        "--threads",
        "1",
    ],
)
def test_train_step_bench_times_both_mixes_and_reports_its_figures(background_runs):
    """bench/train_step.py on the smallest workload that still prints its line (its own engine for
    the demo mix's real rollout) times padded against packed updates on both mixes and ends with
    the issue's line: speedups, padded fractions and the peak ratio, as numbers (their values are
    not checked at this size)."""
    line = background_runs.lines("train_step_bench")[-1]
    assert re.fullmatch(
        r"train_step: mix=demo speedup=[\d.]+ padded_fraction=[\d.]+ mix=gsm8k speedup=[\d.]+ "
        r"padded_fraction=[\d.]+ peak_ratio=[\d.]+",
        line,
    ), line


@pytest.mark.background(
    "train_step_shape_bench",
    [
        sys.executable,
        "bench/train_step.py",
        "--shape",
        "tiny",
        "--repeats",
        "1",
        "--gsm8k-samples",
        "8",
        "--response-median",  # ~40-token answers: half the tokens of GSM8K's, half the CPU
        "40",
        "--threads",
        "1",
        "--compile",
        "false",
        "--fsdp",
        "--lora",
        "8",
    ],
)
def test_train_step_bench_at_a_shape_prints_the_gpu_line_on_cpu(background_runs):
    """bench/train_step.py --shape, the command a GPU user runs, at the tiny shape on CPU (eager:
    compiling its arms would cost minutes here): its parity check passes (packed sdpa here,
    FlexAttention on a GPU; each sample whole and with its group's prompt shared), FlexAttention is
    named as not run (no backward on CPU), every arm (the baseline, the path as shipped, top_p on
    random and on peaked logits, rank-8 LoRA, the prompt shared, FSDP2 on one rank) trains the
    same tokens with no recompile after its warm-up and an estimate in GiB (LoRA's below the full
    model's), and the last line is the issue's."""
    lines = background_runs.lines("train_step_shape_bench")
    assert lines[0].startswith("parity: packed sdpa vs padded sdpa, one fp32 update"), lines[0]
    assert "packed flex_attention: not run (FlexAttention has no backward on CPU)" in lines
    arms = [line for line in lines if " arm=" in line]
    names = [re.search(r"arm=(\S+)", line)[1] for line in arms]
    assert names == ["baseline", "now-sdpa", "top_p", "top_p-peaked", "lora", "shared", "fsdp"]
    assert len({re.search(r"tokens=(\d+)", line)[1] for line in arms}) == 1
    assert all(" recompiles=0 " in line for line in arms)
    estimates = [float(re.search(r"estimate_gib=([\d.]+)", line)[1]) for line in arms]
    assert all(gib > 0 for gib in estimates)
    assert estimates[names.index("lora")] < estimates[names.index("now-sdpa")]  # no fp32 masters
    assert "pi_old=recomputed" in arms[0] and all("pi_old=detached" in line for line in arms[1:])
    # each top_p arm timed against top_p 1 on its own model, in turns; mfu_run (the head only
    # where it ran) below the 6N convention's
    assert all(re.search(r" top_p_ratio=[\d.]+ ", line) for line in arms if "arm=top_p" in line)
    # issue 42's line, printed as its arm ends (a later arm's failure or timeout cannot lose it)
    ratio = r"update time at top_p 0.9 / at 1 = [\d.]+ \(one model, the two in turns; recompiles"
    peaked = lines[lines.index(arms[names.index("top_p-peaked")]) + 1]
    assert re.fullmatch(rf"top_p-peaked: {ratio} after warm-up 0\)", peaked), peaked
    # the shared arm against its prompts computed per sample, in turns: the same tokens trained,
    # fewer positions computed (the samples' groups of 8 share a prompt of ~150 tokens)
    shared = arms[names.index("shared")]
    assert re.search(r" shared_prefix_ratio=[\d.]+ ", shared), shared
    computed = [int(re.search(r" computed=(\d+)", line)[1]) for line in arms]
    tokens = [int(re.search(r" tokens=(\d+)", line)[1]) for line in arms]
    assert [c < t for c, t in zip(computed, tokens)] == [name == "shared" for name in names]
    assert any(line.startswith("parity: packed sdpa, prompt shared, vs padded") for line in lines)
    assert all(
        float(re.search(r"mfu_run=([\d.]+)", line)[1]) < float(re.search(r" mfu=([\d.]+)", line)[1])
        for line in arms
    )
    summary = re.fullmatch(  # no peak measured on CPU: nan
        r"train_step_gpu: device=cpu shape=tiny best=now-sdpa baseline_mfu=[\d.]+ mfu=[\d.]+ "
        r"fsdp_mfu=[\d.]+ tok_s=[\d.]+ peak_gib=nan estimate_gib=[\d.]+",
        lines[-1],
    )
    assert summary, lines[-1]


@pytest.mark.background(
    "grad_sync_bench",
    [
        sys.executable,
        "bench/grad_sync.py",
        "--samples",
        "2",
        "--repeats",
        "1",
        "--max-tokens",
        "256",
    ],
)
def test_grad_sync_bench_syncs_once_per_minibatch_to_the_same_parameters(background_runs):
    """2 ranks (its own processes): syncing gradients once per minibatch must end at the same
    parameters, over several micro-batches (a budget under each sample's length: a micro-batch
    each)."""
    lines = background_runs.lines("grad_sync_bench")
    assert int(lines[-2].split()[0]) >= 2, lines[-2]
    line = lines[-1]
    match = re.fullmatch(
        r"grad_sync: micro_batch_s=[\d.]+ minibatch_s=[\d.]+ speedup=[\d.]+ max_param_diff=(\S+)",
        line,
    )
    assert match and float(match[1]) < 1e-6, line


def test_pack_rows_of_nothing_or_only_over_budget_sequences():
    """A rank with nothing to train (or only sequences over the budget) packs without error: the
    2-rank step with partial rollout can leave a rank no finished sample."""
    assert update.pack_rows([], max_tokens=64) == []
    assert update.pack_rows([100, 90], max_tokens=64) == [[[0]], [[1]]]
    layout = update.pack_rows([5] * 9, max_tokens=40)  # 8 rows of 5 fit one micro-batch: 9 rows
    assert [len(mb) for mb in layout] == [4, 5]  # shared evenly, no 1-row remainder


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_packed_micro_batch_with_no_response_token_scores_zeros(top_p, tmp_path):
    """A packed micro-batch whose samples have empty responses (aborted before their first token,
    or one alone over the budget) runs the head on nothing: its log-probs are zeros in the [B, T-1]
    layout the padded path gives (the gather from an empty head output raised IndexError), at
    top_p < 1 too (an empty nucleus search raised RuntimeError)."""
    policy, _ = model.build_policy(dist_worker.parity_config(tmp_path, "token-mean"), None)
    empty = Sample([5, 6, 7], [], [], [], group_id=0, masked=True, finish_reason="abort")
    shapes = []
    for budget in (0, 100):  # padded, packed
        (batch,), _ = update.micro_batches([empty], 3, 0, max_tokens=budget)
        with torch.no_grad():
            logprobs, _ = update.sequence_logprobs(policy, batch, 1.0, top_p=top_p)
        shapes.append(logprobs.shape)
    assert shapes[0] == shapes[1] and torch.equal(logprobs, torch.zeros(1, 2))


def test_a_padding_micro_batch_is_padding_in_the_layout_figures():
    """A rank with no samples runs one padding micro-batch (every rank must run as many): the
    model computed two positions and trained none, so train/tokens is 0 and all of it padding
    (it read 2 tokens and no padding), packed or padded."""
    for max_tokens in (0, 64):
        batches, _ = update.micro_batches([], 4, 0, max_tokens)
        stats = local_values(update.layout_stats(batches))
        assert len(batches) == 1 and stats["train/tokens"] == 0, stats
        assert stats["train/padded_fraction"] == 1.0, stats
