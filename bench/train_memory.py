"""Peak memory of one micro-batch forward + backward through the log-prob path: the old one (full
[B, T, V] logits, then full-size fp32 copies and an entropy that keeps its graph) against the
trainer's update.sequence_logprobs (the output head computes log-probs chunk by chunk,
checkpointed, entropy without a graph), on a Qwen2-shaped model with Qwen's vocabulary.

Each arm runs in a fresh process; on CPU its peak is the process's peak resident set minus what it
held before the forward (the model and the batch), on a GPU `torch.cuda.max_memory_allocated()`. The
last line is what issue 10 checks: train_memory: vocab=<n> seq_len=<n> micro_batch=<n>
old_peak_bytes=<n> new_peak_bytes=<n> ratio=<f>
"""

import argparse
import json
import os
import resource
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import update  # noqa: E402


def old_token_logprobs(logits, target_ids, temperature=1.0):
    """The log-prob path before issue 10, kept here for the comparison: an fp32 copy, a tempered
    copy and the log-softmax of the whole [B, T, V] alive at once, and an entropy that keeps its
    graph."""
    log_probs = F.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = log_probs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


def rss_bytes():
    """Resident set size now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_arm(arm, vocab, seq_len, micro_batch, hidden, layers, device):
    """One forward + backward of a micro-batch; returns the bytes it added at its peak."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len + 1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(device)
    input_ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    mask = torch.ones(micro_batch, seq_len - 1, device=device)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "targets": input_ids[:, 1:],
    }
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes()
    if arm == "old":
        logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
        logprobs, _entropy = old_token_logprobs(logits, batch["targets"])
    else:
        logprobs, _entropy = update.sequence_logprobs(model, batch, 1.0)
    # the entropy is only logged: no gradient through it
    loss = -(logprobs * mask).sum() / mask.sum()
    loss.backward()
    if on_gpu:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--hidden", type=int, default=64, help="small: the log-prob path is what is measured"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # internal: one arm per process
    parser.add_argument("--arm", choices=["old", "new"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.vocab, args.seq_len, args.micro_batch, args.hidden, args.layers, args.device)
    if args.arm:
        torch.set_num_threads(2)
        print(json.dumps({"peak_bytes": run_arm(args.arm, *shape)}))
        return
    peaks = {}
    for arm in ("old", "new"):  # a fresh process each: a CPU process's peak RSS never goes down
        command = [sys.executable, __file__, "--arm", arm] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "arm"
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        peaks[arm] = json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]
        print(f"{arm}: peak {peaks[arm] / 2**30:.2f} GiB over the model and batch ({args.device})")
    print(
        f"train_memory: vocab={args.vocab} seq_len={args.seq_len} micro_batch={args.micro_batch} "
        f"old_peak_bytes={peaks['old']} new_peak_bytes={peaks['new']} "
        f"ratio={peaks['new'] / peaks['old']:.3f}"
    )


if __name__ == "__main__":
    main()
