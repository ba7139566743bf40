"""Every seed of a run, derived from `train.seed` by one function: `derive(run_seed, *path)`, where
the path names the use (("model",), ("rollout", step, "train"), ("stream", epoch), ...). One run
seed fixes all of them, and no two uses share a seed by accident (a sum such as seed + step + 1
makes step 1 of seed 0 and step 0 of seed 1 alike).

Owns nothing else; imports nothing of this repository (every layer may call it).
"""

import hashlib


def derive(run_seed, *path):
    """The seed of the use `path` under `run_seed`: a hash of both, below 2**31 (SGLang stores a
    request's sampling_seed as int64; torch and random take any int). Each use, and where it is
    derived: ("model",) the tiny policy's initial weights and ("lora",) the adapters' initial
    weights (runtime/model.py); ("prompts", split) the tiny tasks' prompt sets (task/data.py);
    ("stream", epoch) the training prompts' shuffle (task/data.PromptStream); ("engine", start
    step, rank) the engine's own random seed (assemble.start_engine); ("rollout", step, purpose)
    one rollout (rollout.rollout_seed), and under it ("request", index, turn) each request's
    sampling_seed (inflight.request_seed). The update draws nothing at random
    (tests/test_update_passes.py): a checkpoint needs no RNG state.
    """
    text = ":".join(str(part) for part in (run_seed, *path))
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1
