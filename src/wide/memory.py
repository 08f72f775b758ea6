"""Will it fit? A short memory estimate, and a refusal that names a split that fits (at most :data:`HEADROOM` of
the available memory). Training, values per token (``d`` hidden, ``H`` / ``KV`` heads of ``hd``, FFN ``I``, ``L``
layers, vocabulary ``V``): a layer keeps ``A = 3 d + 2 (H + 2 KV) hd + 5 I`` (+ routers, LoRA, ``3 H T`` with eager
attention); ``(L + 1) A`` are live (``L d + 3 A`` with checkpointing); the loss ``7 V`` float32; 12 bytes a trained
parameter. Evaluation: one layer, the KV cache ``2 L KV hd``, 16 bytes a logit, the weights (x2 dequantizing GGUF).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wide.config import ModelDims
from wide.errors import WideError
from wide.model import dims_of, router_param_count

GIB = 2 ** 30
HEADROOM = 0.9
OPTIMIZER_BYTES_PER_PARAM = 12


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory(device) -> tuple[int, str] | None:
    """``(bytes, where the number comes from)`` a new allocation on ``device`` can use, None when unknown: the CPU's
    ``MemAvailable`` (lowered to a cgroup's limit minus its usage), or CUDA's free memory plus PyTorch's cache."""
    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0] + max(cached, 0)), f"free on {device}"
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    for v2, files in ((True, ("memory.max", "memory.current")), (False, ("limit_in_bytes", "usage_in_bytes"))):
        limit, usage = (_read_int("/sys/fs/cgroup/" + ("" if v2 else "memory/memory.") + f) for f in files)
        if limit is not None and usage is not None and limit - usage < avail:
            return max(limit - usage, 0), "this cgroup's memory limit minus its usage"
    return avail, "MemAvailable of this machine"


def _layer_values(dims: ModelDims, seq_len: int, eager_attention: bool = False) -> float:
    a = 3 * dims.hidden_size + 2 * (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim + 5 * dims.intermediate_size
    return a + (3 * dims.num_heads * seq_len if eager_attention else 0)


@dataclass(frozen=True)
class TrainMemory:
    """A model's side of the training estimate: ``extra_layer_values`` (routers, LoRA) and ``retained_layer_values``
    (kept even with checkpointing: LoRA dropout's temporaries) per token and layer, and the trained parameters."""

    dims: ModelDims
    vocab_size: int
    act_bytes: int
    eager_attention: bool
    extra_layer_values: float
    retained_layer_values: float
    trainable_params: int

    def estimate(self, batch_size: int, seq_len: int, grad_checkpoint: bool) -> int:
        """Bytes of one micro-batch's forward and backward beyond the loaded weights."""
        a = _layer_values(self.dims, seq_len, self.eager_attention) + self.extra_layer_values
        L = self.dims.num_layers
        stack = L * self.dims.hidden_size + 3 * a if grad_checkpoint else (L + 1) * a
        per_token = (stack + L * self.retained_layer_values) * self.act_bytes + 7 * self.vocab_size * 4
        return int(batch_size * seq_len * per_token + OPTIMIZER_BYTES_PER_PARAM * self.trainable_params)


def _router_values(config, n_groups: tuple[int, int]) -> float:
    """Per token and layer: each router's bottleneck, logits, noise, mask and gated copy."""
    return sum(4 * config.router_rank + 8 * n for n, on in zip(n_groups, (config.route_attn, config.route_ffn)) if on)


def train_memory_of(wm, device=None) -> TrainMemory:
    """:class:`TrainMemory` of a :class:`wide.model.WideModel` on ``device`` (CUDA: bf16 activations), with its peft
    LoRA layers and its parameters with ``requires_grad`` (all routers when none is marked)."""
    device = torch.device(device) if device is not None else next(wm.base.parameters()).device
    kept = retained = 0.0
    for mod in wm.base.modules():
        if isinstance(getattr(mod, "lora_A", None), torch.nn.ModuleDict):
            for name, lin in mod.lora_A.items():
                dropped = float(getattr(mod.lora_dropout[name], "p", 0.0)) > 0.0
                kept += 2 * lin.out_features + 2 * lin.in_features * dropped
                retained += 3 * lin.in_features * dropped
    L = max(wm.dims.num_layers, 1)
    trained = sum(p.numel() for p in wm.parameters() if p.requires_grad) or wm.router_param_count()
    act = 2 if device.type == "cuda" else next(wm.base.parameters()).element_size()
    return TrainMemory(wm.dims, int(wm.base.config.vocab_size), act,
                       getattr(wm.base.config, "_attn_implementation", None) == "eager",
                       _router_values(wm.config, (wm.n_attn_groups, wm.n_ffn_groups)) + kept / L, retained / L, trained)


def train_memory_from_config(hf_config, config, device) -> TrainMemory:
    """:class:`TrainMemory` of stage 1 from a Hugging Face config and a WideConfig alone, before weights load."""
    dims = dims_of(hf_config)
    rc = config.resolve(dims)
    return TrainMemory(dims, int(hf_config.vocab_size), 2 if torch.device(device).type == "cuda" else 4,
                       getattr(hf_config, "_attn_implementation", None) == "eager",
                       _router_values(rc, rc.n_groups(dims)), 0.0, router_param_count(dims, rc))


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def check_train_memory(wm, batch_size: int, seq_len: int, *, device=None, **kw) -> int | None:
    """:func:`check_train_fits` for a loaded :class:`wide.model.WideModel` on ``device`` (default: its weights')."""
    mem = train_memory_of(wm, device)
    return check_train_fits(mem, batch_size, seq_len, device=device or next(wm.base.parameters()).device, **kw)


def check_train_fits(mem: TrainMemory, batch_size: int, seq_len: int, *, device, grad_checkpoint: bool = False,
                     grad_accum: int = 1, procs: int = 1, checkpoint_option: str | None = "--grad-checkpoint"):
    """The estimate in bytes (None: memory unknown), or a one-line WideError when it does not fit (``procs`` processes
    share the CPU), offering a smaller ``--batch-size`` with a ``--grad-accum`` keeping the step's sequences, then
    activation checkpointing (``checkpoint_option``), then a shorter ``--seq-len``."""
    device = torch.device(device)
    got = available_memory(device)
    if got is None:
        return None
    avail, where = got
    procs = max(int(procs), 1) if device.type == "cpu" else 1

    def need(b: int, t: int, ckpt: bool) -> int:
        return procs * mem.estimate(b, t, ckpt)

    def fits(b: int, t: int, ckpt: bool) -> bool:
        return need(b, t, ckpt) <= HEADROOM * avail

    est = need(batch_size, seq_len, grad_checkpoint)
    if est <= HEADROOM * avail:
        return est
    seqs = batch_size * grad_accum
    options = [grad_checkpoint] + ([True] if checkpoint_option and not grad_checkpoint else [])
    divisors = sorted({d for k in range(1, math.isqrt(seqs) + 1) if seqs % k == 0 for d in (k, seqs // k)},
                      reverse=True)
    tip = next(((b, seq_len, c) for c in options if fits(1, seq_len, c)
                for b in divisors if b <= batch_size and fits(b, seq_len, c)), None)
    t = seq_len // 2
    while tip is None and t >= 2:
        tip, t = ((1, t, options[-1]) if fits(1, t, options[-1]) else None), t // 2
    fix = "not even one sequence of 2 tokens fits"
    if tip is not None:
        b, t, ckpt = tip
        opts = [str(checkpoint_option)] * (ckpt and not grad_checkpoint) + [f"--seq-len {t}"] * (t != seq_len)
        keep = ""
        if b != batch_size and seqs // b <= 1024:
            opts.append(f"--batch-size {b} --grad-accum {seqs // b}")
            keep = "" if t != seq_len else f", the same {seqs} sequences per step"
        elif b != batch_size:  # the step's sequences would take too many micro-batches: the largest batch that fits
            lo, hi = b, batch_size - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid, t, ckpt) else (lo, mid - 1)
            b = lo
            opts.append(f"--batch-size {b}")
            keep = (f"; keeping {seqs:,} sequences per step would take {-(-seqs // b):,} micro-batches, so choose "
                    f"--grad-accum for the step you mean")
        fix = f"use {' '.join(opts)} (about {_gib(need(b, t, ckpt))}{keep})"
        if t != seq_len:
            fix = f"even --batch-size 1 does not fit at --seq-len {seq_len}: {fix}"
    dtype = {4: "float32", 2: "bfloat16"}.get(mem.act_bytes, f"{mem.act_bytes}-byte")
    how = (f"{dtype} activations on {device.type}" + ", activation checkpointing" * grad_checkpoint
           + f", {procs} processes on this machine" * (procs > 1))
    raise WideError(f"one micro-batch of --batch-size {batch_size} x --seq-len {seq_len} tokens needs about "
                    f"{_gib(est)} for training ({how}; a conservative estimate), but {_gib(avail)} is available "
                    f"({where}; at most {HEADROOM:.0%} of it is used): {fix}; or pass --no-memory-check to try anyway")


def config_param_count(hf_config) -> int:
    """Parameters of the model ``hf_config`` describes (tied weights once), counted on the ``meta`` device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())


def estimate_eval_memory(dims: ModelDims, vocab_size: int, params: int, batch_size: int, ctx: int, *,
                         param_bytes: int = 4, act_bytes: int = 4, gguf: bool = False) -> tuple[int, int]:
    """``(weights, forward)`` bytes of a perplexity evaluation (the module docstring's count; 256 MiB fixed)."""
    kv = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim
    per_token = (_layer_values(dims, ctx) + kv) * act_bytes + 16 * vocab_size
    return int(params * param_bytes * (2.0 if gguf else 1.0)), int(batch_size * ctx * per_token + 2 ** 28)


def check_eval_memory(hf_config, batch_size: int, ctx: int, device, *, gguf: bool = False, asked: int | None = None,
                      ctx_flag: str = "--ctx", item: str = "window", purpose: str = "evaluation") -> int | None:
    """The estimate (None: memory unknown) of the weights (CPU fp32, CUDA bf16) and a forward pass of ``batch_size x
    ctx`` tokens, or a one-line WideError naming a ``--batch-size`` (or ``ctx_flag``) that fits. ``asked``: the
    ``--batch-size`` given when ``batch_size`` is it capped; ``item`` and ``purpose`` name things."""
    device = torch.device(device)
    got = available_memory(device)
    if got is None:
        return None
    avail, where = got
    dims, vocab, nbytes = dims_of(hf_config), int(hf_config.vocab_size), 2 if device.type == "cuda" else 4
    params = config_param_count(hf_config)

    def need(b: int, t: int) -> tuple[int, int]:
        return estimate_eval_memory(dims, vocab, params, b, t, param_bytes=nbytes, act_bytes=nbytes, gguf=gguf)

    weights, forward = need(batch_size, ctx)
    if weights + forward <= HEADROOM * avail:
        return weights + forward
    tip = next((b for b in range(batch_size - 1, 0, -1) if sum(need(b, ctx)) <= HEADROOM * avail), None)
    t = ctx // 2
    while tip is None and t >= 2 and sum(need(1, t)) > HEADROOM * avail:
        t //= 2
    note = "; shorter windows give a higher perplexity" if purpose == "evaluation" else ""
    fix = (f"use --batch-size {tip} (about {_gib(sum(need(tip, ctx)))})" if tip is not None else
           f"use --batch-size 1 {ctx_flag} {t} (about {_gib(sum(need(1, t)))}{note})" if t >= 2 else
           f"the weights alone need {_gib(weights)}: use a machine or device with more memory")
    s = "s" if batch_size != 1 else ""
    what = (f"all {batch_size} {item}{s} of the text (--batch-size {asked} is capped at the number of {item}s)"
            if asked is not None and asked > batch_size else f"{batch_size} {item}{s} (--batch-size)")
    raise WideError(f"a forward pass of {what} x {ctx} tokens ({ctx_flag}) needs about {_gib(weights + forward)} for "
                    f"{purpose} ({_gib(weights)} for the {'float32' if nbytes == 4 else 'bfloat16'} weights"
                    f"{' (the peak while they are dequantized from GGUF)' if gguf else ''} and {_gib(forward)} for the "
                    f"pass, of which {_gib(batch_size * ctx * vocab * 16)} are the [{batch_size} x {ctx} x {vocab}] "
                    f"logits and their float32 loss; a conservative estimate), but {_gib(avail)} is available "
                    f"({where}; at most {HEADROOM:.0%} of it is used): {fix}; or pass --no-memory-check to try anyway")
