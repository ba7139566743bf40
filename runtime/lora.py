"""LoRA: the policy as a frozen base plus trainable low-rank adapters (model.lora_rank > 0).

Each linear layer named in model.lora_targets keeps its weight W, frozen, and gains two trainable
matrices, A [r, in] and B [out, r], so it computes x W^T + scale * x A^T B^T with scale =
alpha / r (Hu et al. 2021), without dropout (config.RETIRED says why). B starts at zero, so the
adapted model starts as the base. Only the adapters train (and what model.lora_also_train names,
in full): AdamW keeps state for them alone, and the base sits in the compute dtype (no fp32
master of a weight that never changes). Written by
hand rather than with peft: the whole feature is `add_adapters` and one forward, the parameter
names of the base do not change (checkpoints, the weight sync and the engine read them as before),
and `adapters_off` gives the KL reference without a second model.

The engine holds the base and serves the adapter from SGLang's LoRA pool: each weight push sends
the adapter alone (`adapter_tensors`, in peft's names and `adapter_config`), plus what trains in
full beside it (`base_weights`); HF folders hold merged weights, W + scale * B A per adapted layer
(`merged`), which any engine or `from_pretrained` loads. Does not own when weights move
(memory.py) nor the optimizer (runtime/model.py).
"""

import contextlib
import json
import math
import os

import safetensors.torch
import torch
import torch.nn.functional as F


def adapted(model):
    """{module name: module} of the linear layers carrying adapters."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A")}


def is_target(module_name, targets):
    """Whether the module of this name gets an adapter (if it is an nn.Linear): its last part is
    one of model.lora_targets (`q_proj` adapts model.layers.*.self_attn.q_proj)."""
    return module_name.rsplit(".", 1)[-1] in targets


def is_also_trained(parameter_name, also_train):
    """Whether a parameter trains in full beside the adapters: a part of model.lora_also_train is
    in its name (`norm` names every norm's weight)."""
    return any(part in parameter_name for part in also_train)


def add_adapters(model, rank, alpha, targets, base_dtype, also_train=()):
    """Give each nn.Linear whose name ends in one of `targets` a rank-`rank` adapter (A random as
    nn.Linear's default init, B zero: the model is unchanged), freeze every other parameter and
    hold it in `base_dtype`, except those whose name holds a part of `also_train` (trained in full,
    fp32). Returns the adapted layers' names."""
    # a part in an adapted layer's weight's name ('', '.', 'weight', 'layers') would train that
    # weight in full under its own adapter: the whole model, where an empty part was given
    targeted = [
        f"{n}.weight"
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and is_target(n, targets)
    ]
    overlapping = [part for part in also_train if any(part in w for w in targeted)]
    if overlapping:
        part = overlapping[0]
        weight = next(w for w in targeted if part in w)
        raise ValueError(
            f"model.lora_also_train: {overlapping} would train the adapted weights in full "
            f"({part!r} is in {weight}): name parts found only in the other parameters' names "
            "(norm, embed_tokens, lm_head)"
        )
    for name, parameter in model.named_parameters():
        trained = is_also_trained(name, also_train)
        parameter.requires_grad_(trained)
        if not trained:
            parameter.data = parameter.data.to(base_dtype)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not is_target(name, targets):
            continue
        weight = module.weight
        a = torch.empty(rank, module.in_features, device=weight.device, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        module.lora_A = torch.nn.Parameter(a)
        module.lora_B = torch.nn.Parameter(
            torch.zeros(module.out_features, rank, device=weight.device, dtype=torch.float32)
        )
        module.lora_scale = alpha / rank
        module.lora_on = True
        module.forward = _forward.__get__(module)  # this instance only: nn.Linear is untouched
        names.append(name)
    # a rank above every adapted layer's smaller side adds parameters, not rank: each update is
    # full rank already (above some layers' only, as GQA's narrow k and v, it still adds rank to
    # the others)
    widest = max((min(m.in_features, m.out_features) for m in adapted(model).values()), default=0)
    if names and rank > widest:
        raise ValueError(
            f"model.lora_rank={rank} is above every adapted layer's rank (at most {widest}): "
            f"use at most {widest}, or train every weight (model.lora_rank: 0)"
        )
    # a name that matches nothing (a typo) would train less than it says, silently
    found = {name.rsplit(".", 1)[-1] for name in names}
    unmatched = [t for t in targets if t not in found]
    if unmatched:
        linear = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear)
            }
        )
        raise ValueError(
            f"model.lora_targets: {unmatched} name no linear layer of the model (its linear "
            f"layers: {linear})"
        )
    params = [name for name, _ in model.named_parameters()]
    unmatched = [part for part in also_train if not any(part in name for name in params)]
    if unmatched:
        raise ValueError(f"model.lora_also_train: {unmatched} are in no parameter's name")
    return names


def _forward(self, x):
    """An adapted nn.Linear: the frozen projection plus the low-rank update (skipped while the
    adapters are off)."""
    out = F.linear(x, self.weight, self.bias)
    if not self.lora_on:
        return out
    update = F.linear(F.linear(x, self.lora_A), self.lora_B)
    return out + update * self.lora_scale


@contextlib.contextmanager
def adapters_off(model):
    """Inside: `model` computes its frozen base (the KL reference, with no second copy)."""
    layers = adapted(model).values()
    for module in layers:
        module.lora_on = False
    try:
        yield model
    finally:
        for module in layers:
            module.lora_on = True


class Base:
    """The policy with its adapters off, as a model to call: the KL reference of a LoRA run. The
    same parameters, so it holds no memory of its own (what memory.py counts and moves is the
    policy's)."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with adapters_off(self.policy):
            return self.policy(*args, **kwargs)

    def __getattr__(self, name):  # config, get_output_embeddings, ...: the policy's
        return getattr(self.policy, name)


def merged_weights(model):
    """(name, tensor) of the model as one set of weights, what a HF folder holds: `merged` over
    its parameters."""
    return merged(model.named_parameters(), model)


def adapter_tensors(model, gather=None):
    """{peft name: fp32 tensor} of the adapters (empty without): what SGLang's
    load_lora_adapter_from_tensors reads, named as peft saves them
    (base_model.model.<layer>.lora_A.weight). `gather` makes each whole (parallel.full_tensor,
    a collective, under FSDP2: every rank calls it). Copies, never the live parameters: the push
    serializes them, which moves a CPU tensor's storage into shared memory, and the engine's
    adapter would then be the trainer's, changing as it trains."""
    gather = gather or (lambda tensor: tensor)
    return {
        f"base_model.model.{name}.weight": gather(parameter.detach().clone())
        for name, parameter in model.named_parameters()
        if ".lora_" in name
    }


def adapter_config(model):
    """The adapters' peft adapter_config: rank, alpha, the adapted layers' names."""
    layers = adapted(model)
    first = next(iter(layers.values()))
    rank = first.lora_A.shape[0]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": first.lora_scale * rank,
        "lora_dropout": 0.0,  # none in training either (config.RETIRED says why)
        "bias": "none",
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers}),
    }


def save_adapter(tensors, config, folder):
    """`folder` as peft writes an adapter: `tensors` (`adapter_tensors`, whole) in
    adapter_model.safetensors, `config` (`adapter_config`) in adapter_config.json; what peft's
    PeftModel.from_pretrained and SGLang's --lora-paths read. It holds the adapters alone: what
    model.lora_also_train trains in full is in the checkpoint's sharded state and in its merged
    export (checkpoint.merged_export)."""
    os.makedirs(folder, exist_ok=True)
    tensors = {name: t.float().contiguous().cpu() for name, t in tensors.items()}
    safetensors.torch.save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def base_weights(model, trained_only=False):
    """(name, tensor) of every parameter but the adapters (`trained_only`: those that train in
    full beside them, model.lora_also_train)."""
    for name, parameter in model.named_parameters():
        if ".lora_" not in name and (parameter.requires_grad or not trained_only):
            yield name, parameter


def merged(tensors, model):
    """(name, tensor) of `tensors` (a model's parameters or full state dict, as pairs), each
    adapted layer's weight merged, W + scale * B A in the base's dtype, and the adapters left
    out: what a merged HF folder holds (checkpoint.merged_export; the engine serves the base and
    the adapter from its LoRA pool). Without adapters: `tensors` as they are."""
    tensors = dict(tensors)
    scales = {f"{name}.weight": m.lora_scale for name, m in adapted(model).items()}
    for name, tensor in tensors.items():
        if ".lora_" in name:
            continue
        if name in scales:
            prefix = name[: -len("weight")]
            delta = (tensors[prefix + "lora_B"] @ tensors[prefix + "lora_A"]) * scales[name]
            tensor = (tensor.float() + delta.float()).to(tensor.dtype).detach()
        yield name, tensor
