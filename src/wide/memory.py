"""Will one training micro-batch fit? An estimate of its forward + backward memory, and the memory available.

:func:`wide.train.loop.train` calls :func:`check_train_memory` before its first step, so that a batch too large
for the machine ends with one line naming the estimate, the memory available and a batch split that fits,
instead of the operating system's OOM killer ending the process without a word. ``wide eval-ppl`` likewise calls
:func:`check_eval_memory` before the weights load (weights plus one forward pass, whose ``batch x ctx x vocab``
logits are the big term; :func:`estimate_eval_memory`).

The estimate (:func:`estimate_train_memory`), in values per token of the micro-batch (``N = batch x seq_len``
tokens), with ``d`` the hidden size, ``H`` / ``KV`` the query / key-value heads of ``hd`` channels, ``I`` the
FFN size, ``L`` the layers, ``V`` the vocabulary and ``T`` the sequence length:

* one decoder layer keeps ``A = 3 d + 2 (H + 2 KV) hd + 5 I`` values for its backward (norm inputs and
  outputs; Q, K, V and their rotated copies; gate, up, ``act(gate)``, their product and its gated copy),
  plus the routers' and LoRA's own tensors (``extra_layer_values``: per router ``4 r`` and ``8`` per group;
  per LoRA projection ``2 r`` plus, with dropout, ``2 in`` for its mask and output), plus ``3 H T`` with eager
  attention (its ``[H, T, T]`` scores; SDPA's kernels keep no such matrix);
* without activation checkpointing all ``L`` layers keep theirs, and the backward of one layer needs about
  one layer's worth more: ``(L + 1) A``; with it, each layer keeps only its input, and the one layer being
  recomputed holds its activations and their gradients: ``L d + 3 A``;
* memory every layer's forward leaves behind even with checkpointing (``retained_layer_values``, ``L`` times):
  LoRA dropout's temporaries (uniform draws, masked input), ``3 in`` per projection, which the allocator
  keeps (measured 3.4 ``in`` per layer with and without checkpointing);
* the loss: ``7 V`` float32 values (the logits, their float32 log-softmax, the gradients of both and the
  temporaries of the backward; measured 4.2 to 5.8 ``V``), whatever the model's dtype;
* the trained parameters: 12 bytes each (float32 gradient and AdamW's two moments).

Layer values take the activation dtype's size (float32 on CPU, bfloat16 under CUDA autocast). The base
weights are not counted: they are loaded already, so the available memory is measured without them.

Measured on the bundled SmolLM2-135M (CPU, float32, SDPA; the peak RSS of one training step, ``ru_maxrss``,
over the RSS before it, per token, for 512 to 2048 tokens): stage 1 2.05 MiB (estimate 2.68), stage 1 with
activation checkpointing 1.17-1.25 MiB (estimate 1.51), stage 2 (LoRA r=16, dropout 0.1) 2.97 MiB at 512
tokens and 4.70 MiB at 1024-2048 (estimate 5.63). ``tests/test_training.py`` checks the estimate against a
measured step of a small model. A micro-batch is accepted when its estimate is at most :data:`HEADROOM` of
the available memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wide.config import ModelDims
from wide.errors import WideError

GIB = 2 ** 30
HEADROOM = 0.9  # use at most this fraction of the available memory (allocator slack, other processes)
LOGIT_VALUES = 7  # float32 values per token and vocabulary entry held around the loss (measured 4.2-5.8)
OPTIMIZER_BYTES_PER_PARAM = 12  # float32 gradient + AdamW exp_avg + exp_avg_sq


def layer_values(dims: ModelDims, seq_len: int, *, eager_attention: bool = False, extra: float = 0.0) -> float:
    """``A``: activation values one decoder layer keeps per token for its backward (see the module docstring).

    Args:
        dims: the base model's shape.
        seq_len: tokens per sequence ``T`` (only matters with ``eager_attention``).
        eager_attention: the model materializes ``[H, T, T]`` attention scores (``attn_implementation="eager"``).
        extra: further values per token and layer (routers, LoRA).

    Returns:
        values per token (a count, not bytes).
    """
    d, hd, i = dims.hidden_size, dims.head_dim, dims.intermediate_size
    a = 3 * d + 2 * (dims.num_heads + 2 * dims.num_kv_heads) * hd + 5 * i + extra
    if eager_attention:
        a += 3 * dims.num_heads * seq_len
    return a


def estimate_train_memory(dims: ModelDims, vocab_size: int, batch_size: int, seq_len: int, *,
                          grad_checkpoint: bool = False, act_bytes: int = 4, eager_attention: bool = False,
                          extra_layer_values: float = 0.0, retained_layer_values: float = 0.0,
                          trainable_params: int = 0) -> int:
    """Peak memory of one training micro-batch's forward + backward beyond the loaded weights, in bytes.

    The formula and its measured accuracy are in the module docstring; it errs on the high side (by about
    20-35% on SmolLM2-135M; more with eager attention).

    Args:
        dims: the base model's shape.
        vocab_size: ``V``, the width of the logits.
        batch_size: sequences per micro-batch (per process).
        seq_len: tokens per sequence.
        grad_checkpoint: activation checkpointing of every decoder layer.
        act_bytes: bytes per activation value (4 for float32, 2 for bfloat16 / float16 autocast).
        eager_attention: the model's attention materializes ``[B, H, T, T]`` scores.
        extra_layer_values: values per token and layer kept for the backward on top of the base layer
            (routers, LoRA); dropped with checkpointing like the rest of the layer.
        retained_layer_values: values per token and layer that every layer's forward leaves allocated, with
            or without checkpointing (LoRA dropout's temporaries).
        trainable_params: number of trained parameters (their gradients and optimizer state are counted).

    Returns:
        bytes (an int).
    """
    a = layer_values(dims, seq_len, eager_attention=eager_attention, extra=extra_layer_values)
    L = dims.num_layers
    stack = (L * dims.hidden_size + 3 * a) if grad_checkpoint else (L + 1) * a
    per_token = (stack + L * retained_layer_values) * act_bytes + LOGIT_VALUES * vocab_size * 4
    return int(batch_size * seq_len * per_token + OPTIMIZER_BYTES_PER_PARAM * trainable_params)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory(device: torch.device | str) -> tuple[int, str] | None:
    """Memory a new allocation on ``device`` can use now, in bytes, and where the number comes from.

    CPU: ``MemAvailable`` of ``/proc/meminfo``, lowered to the cgroup's limit minus its usage when a cgroup
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) sets a lower one. CUDA: ``torch.cuda.mem_get_info`` plus
    what PyTorch's caching allocator holds reserved but unused.

    Returns:
        ``(bytes, description)``, or None where it cannot be told (no ``/proc/meminfo``, another device type).
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0)), f"free on {device}"
    if device.type != "cpu":
        return None
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        return None
    if avail is None:
        return None
    where = "MemAvailable of this machine"
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)  # "max" (no limit) reads as None
        if limit is not None and usage is not None and limit - usage < avail:
            avail, where = max(limit - usage, 0), "this cgroup's memory limit minus its usage"
            break
    return avail, where


@dataclass(frozen=True)
class TrainMemory:
    """What :func:`train_memory_of` derived from a model: everything :func:`estimate_train_memory` needs
    besides the batch shape."""

    dims: ModelDims
    vocab_size: int
    act_bytes: int
    eager_attention: bool
    extra_layer_values: float
    retained_layer_values: float
    trainable_params: int

    def estimate(self, batch_size: int, seq_len: int, grad_checkpoint: bool) -> int:
        """:func:`estimate_train_memory` for this model, in bytes."""
        return estimate_train_memory(self.dims, self.vocab_size, batch_size, seq_len,
                                     grad_checkpoint=grad_checkpoint, act_bytes=self.act_bytes,
                                     eager_attention=self.eager_attention,
                                     extra_layer_values=self.extra_layer_values,
                                     retained_layer_values=self.retained_layer_values,
                                     trainable_params=self.trainable_params)


def train_memory_of(wm, device: torch.device | str | None = None) -> TrainMemory:
    """The inputs of the estimate for a :class:`wide.model.WideModel` as it will be trained on ``device``.

    Counts the routers and any peft LoRA layer (its rank and, with dropout, its mask, output and temporaries)
    as extra values per layer (see the module docstring), and the parameters with ``requires_grad`` as trained
    (all router parameters when none is marked yet, as in stage 1 before :func:`wide.train.loop.calibrate`).

    Args:
        wm: a :class:`wide.model.WideModel`.
        device: where it will train (default: its weights' device); CUDA means bfloat16 autocast activations.

    Returns:
        a :class:`TrainMemory`.
    """
    base = wm.base
    device = torch.device(device) if device is not None else next(base.parameters()).device
    cfg = base.config
    dims = wm.dims
    extra = 0.0
    for routers, groups in ((wm.attn_routers, wm.n_attn_groups), (wm.ffn_routers, wm.n_ffn_groups)):
        if len(routers):  # bottleneck activations and group logits, noise, mask, gated copy
            extra += 4 * wm.config.router_rank + 8 * groups
    lora_kept = lora_retained = 0.0
    for mod in base.modules():
        lora_a = getattr(mod, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict):  # peft's LoRA layers hold lora_A = {adapter: Linear}
            continue
        drops = getattr(mod, "lora_dropout", {})
        for name, lin in lora_a.items():
            d = drops[name] if name in drops else None
            dropped = d is not None and float(getattr(d, "p", 0.0)) > 0.0
            lora_kept += 2 * lin.out_features + (2 * lin.in_features if dropped else 0)
            lora_retained += 3 * lin.in_features if dropped else 0
    layers = max(dims.num_layers, 1)
    extra += lora_kept / layers
    trained = sum(p.numel() for p in wm.parameters() if p.requires_grad)
    if trained == 0:
        trained = sum(p.numel() for p in wm.router_parameters())
    param_dtype = next(base.parameters()).dtype
    act_bytes = 2 if device.type == "cuda" else torch.empty((), dtype=param_dtype).element_size()
    return TrainMemory(dims=dims, vocab_size=int(cfg.vocab_size), act_bytes=act_bytes,
                       eager_attention=getattr(cfg, "_attn_implementation", None) == "eager",
                       extra_layer_values=extra, retained_layer_values=lora_retained / layers,
                       trainable_params=trained)


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def _divisors_desc(n: int) -> list[int]:
    small = [b for b in range(1, math.isqrt(n) + 1) if n % b == 0]
    return sorted(set(small + [n // b for b in small]), reverse=True)


#: the most micro-batches per step a memory error suggests; a split needing more is not offered as such (the
#: step's sequences were then surely not meant: e.g. --batch-size 100000000 would give --grad-accum 50000000)
MAX_SUGGESTED_GRAD_ACCUM = 1024


def train_memory_from_config(hf_config, config, device: torch.device | str) -> TrainMemory:
    """The inputs of the training estimate from a Hugging Face config and a :class:`wide.config.WideConfig`
    alone, before any weight loads (stage 1: the routers are the only trained parameters; float32 activations
    on CPU, bfloat16 autocast on CUDA, as :func:`train_memory_of` for the loaded model).

    Raises:
        WideError: the config does not fit the WideConfig (:meth:`wide.config.WideConfig.resolve`).
    """
    from wide.model import dims_of, router_param_count

    device = torch.device(device)
    dims = dims_of(hf_config)
    rc = config.resolve(dims)
    n_a, n_f = rc.n_groups(dims)
    extra = 0.0
    if rc.route_attn:
        extra += 4 * rc.router_rank + 8 * n_a
    if rc.route_ffn:
        extra += 4 * rc.router_rank + 8 * n_f
    return TrainMemory(dims=dims, vocab_size=int(hf_config.vocab_size), act_bytes=2 if device.type == "cuda" else 4,
                       eager_attention=getattr(hf_config, "_attn_implementation", None) == "eager",
                       extra_layer_values=extra, retained_layer_values=0.0,
                       trainable_params=router_param_count(dims, rc))


@dataclass(frozen=True)
class Split:
    """A micro-batch shape: ``batch_size`` sequences of ``seq_len`` tokens, ``grad_accum`` per optimizer step."""

    batch_size: int
    grad_accum: int
    seq_len: int
    grad_checkpoint: bool


def suggest_split(fits, batch_size: int, grad_accum: int, seq_len: int, grad_checkpoint: bool,
                  can_checkpoint: bool = True) -> Split | None:
    """The largest micro-batch that ``fits(batch_size, seq_len, grad_checkpoint) -> bool`` accepts.

    Keeps the step's ``batch_size * grad_accum`` sequences. Tries, in order: a smaller batch dividing the
    step's sequences (``grad_accum`` raised to keep them); activation checkpointing (when ``can_checkpoint``)
    with the largest such batch; one sequence per micro-batch with a shorter ``seq_len`` (halved until it fits;
    this changes the training data).

    Returns:
        the :class:`Split`, or None when not even one sequence of 2 tokens fits.
    """
    seqs = batch_size * grad_accum
    options = [grad_checkpoint] + ([True] if can_checkpoint and not grad_checkpoint else [])
    for ckpt in options:
        if not fits(1, seq_len, ckpt):
            continue  # the estimate grows with the batch: not even one sequence fits
        for b in _divisors_desc(seqs):
            if b <= batch_size and (b < batch_size or ckpt != grad_checkpoint) and fits(b, seq_len, ckpt):
                return Split(b, seqs // b, seq_len, ckpt)
    t = seq_len // 2
    while t >= 2:
        if fits(1, t, options[-1]):
            return Split(1, seqs, t, options[-1])
        t //= 2
    return None


def check_train_memory(wm, batch_size: int, seq_len: int, *, grad_checkpoint: bool = False, grad_accum: int = 1,
                       device: torch.device | str | None = None, procs: int = 1,
                       checkpoint_option: str | None = "--grad-checkpoint") -> int | None:
    """Refuse a micro-batch whose forward + backward would not fit in memory; return its estimate.

    Args:
        wm: the :class:`wide.model.WideModel` to train, loaded on its device (LoRA attached for stage 2).
        batch_size: sequences per micro-batch (per process).
        seq_len: tokens per sequence.
        grad_checkpoint: activation checkpointing is on.
        grad_accum: micro-batches per optimizer step (the suggestion keeps ``batch_size * grad_accum``).
        device: where it trains (default: the device of the base model's weights).
        procs: processes of this job sharing the machine's RAM (CPU only; each GPU is counted on its own).
        checkpoint_option: the command's activation-checkpointing option, offered in the suggestion (None:
            the command has none).

    Returns:
        the estimate in bytes, or None when the available memory cannot be told (then nothing is checked).

    Raises:
        WideError: the estimate exceeds :data:`HEADROOM` of the available memory; the message names the
            estimate, the memory available and a ``--batch-size`` / ``--grad-accum`` split (or activation
            checkpointing, or a shorter ``--seq-len``) that fits, and ``--no-memory-check``.
    """
    device = torch.device(device) if device is not None else next(wm.base.parameters()).device
    return check_train_fits(train_memory_of(wm, device), batch_size, seq_len, device=device,
                            grad_checkpoint=grad_checkpoint, grad_accum=grad_accum, procs=procs,
                            checkpoint_option=checkpoint_option)


def check_train_fits(mem: TrainMemory, batch_size: int, seq_len: int, *, device: torch.device | str,
                     grad_checkpoint: bool = False, grad_accum: int = 1, procs: int = 1,
                     checkpoint_option: str | None = "--grad-checkpoint") -> int | None:
    """:func:`check_train_memory` for a :class:`TrainMemory` (from a loaded model, :func:`train_memory_of`, or
    from its config alone, :func:`train_memory_from_config`, so that a batch far too large fails before the
    weights load).

    Returns:
        the estimate in bytes, or None when the available memory cannot be told.

    Raises:
        WideError: as :func:`check_train_memory`. A split that keeps the step's sequences only with more than
            :data:`MAX_SUGGESTED_GRAD_ACCUM` micro-batches is not offered: the message names the largest
            ``--batch-size`` that fits instead; when not even ``--batch-size 1`` fits at ``--seq-len``, it says so.
    """
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
    dtype = {4: "float32", 2: "bfloat16"}.get(mem.act_bytes, f"{mem.act_bytes}-byte")
    how = f"{dtype} activations on {device.type}" + (", activation checkpointing" if grad_checkpoint else "")
    if procs > 1:
        how += f", {procs} processes on this machine"
    tip = suggest_split(fits, batch_size, grad_accum, seq_len, grad_checkpoint, checkpoint_option is not None)
    if tip is None:
        fix = "not even one sequence of 2 tokens fits"
    else:
        opts = []
        if tip.grad_checkpoint and not grad_checkpoint:
            opts.append(str(checkpoint_option))
        if tip.seq_len != seq_len:
            opts.append(f"--seq-len {tip.seq_len}")
        seqs = batch_size * grad_accum
        if tip.batch_size != batch_size and tip.grad_accum <= MAX_SUGGESTED_GRAD_ACCUM:
            opts.append(f"--batch-size {tip.batch_size} --grad-accum {tip.grad_accum}")
            keep = "" if tip.seq_len != seq_len else f", the same {seqs} sequences per step"
        elif tip.batch_size != batch_size:  # keeping the step's sequences would take an absurd --grad-accum
            lo, hi = tip.batch_size, batch_size - 1  # the largest batch that fits, divisor of the step or not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid, tip.seq_len, tip.grad_checkpoint) else (lo, mid - 1)
            tip = Split(lo, 1, tip.seq_len, tip.grad_checkpoint)
            opts.append(f"--batch-size {lo}")
            keep = (f"; keeping {seqs:,} sequences per step would take {-(-seqs // lo):,} micro-batches, so "
                    f"choose --grad-accum for the step you mean")
        else:
            keep = ""
        fix = f"use {' '.join(opts)} (about {_gib(need(tip.batch_size, tip.seq_len, tip.grad_checkpoint))}{keep})"
        if tip.seq_len != seq_len:
            fix = f"even --batch-size 1 does not fit at --seq-len {seq_len}: {fix}"
    raise WideError(f"one micro-batch of --batch-size {batch_size} x --seq-len {seq_len} tokens needs about "
                    f"{_gib(est)} for training ({how}; a conservative estimate), but {_gib(avail)} is available "
                    f"({where}; at most {HEADROOM:.0%} of it is used): {fix}; or pass --no-memory-check to try "
                    f"anyway")


# --- evaluation (wide eval-ppl) -------------------------------------------------------------------------------
#: bytes per token and vocabulary entry around :func:`wide.eval.perplexity.perplexity`'s loss: the logits, their
#: flattened float32 copy and its float32 log-softmax are 12 (measured: 1326 MiB over the loaded SmolLM2-135M for
#: 4 x 512 tokens, of which 1152 MiB are those three), rounded up to 16 for the allocator
EVAL_LOGIT_BYTES = 16
#: one-time allocations of the first forward pass (thread pools, kernels' workspaces; measured 0.2 GiB on CPU)
EVAL_FIXED_BYTES = 256 * 2 ** 20
#: peak memory while a GGUF is loaded (its tensors are dequantized), in units of the model's weights (measured
#: 1.57 for the bundled SmolLM2-135M Q4_1 in float32)
GGUF_LOAD_FACTOR = 2.0


def config_param_count(hf_config) -> int:
    """Parameters of the model that the Hugging Face config ``hf_config`` describes (tied weights once), counted
    on an instance on the ``meta`` device: no memory, no weights read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def estimate_eval_memory(dims: ModelDims, vocab_size: int, params: int, batch_size: int, ctx: int, *,
                         param_bytes: int = 4, act_bytes: int = 4, gguf: bool = False) -> tuple[int, int]:
    """Memory of evaluating perplexity (:func:`wide.eval.perplexity.perplexity`) with a model not loaded yet, in bytes.

    Per token of one forward pass (``batch_size x ctx`` tokens): one decoder layer's activations at a time
    (:func:`layer_values`, the training count, an over-estimate without a backward), the KV cache the forward
    fills (``2 L KV hd`` values) and :data:`EVAL_LOGIT_BYTES` per vocabulary entry (the logits and the float32
    loss around them, the big term); plus :data:`EVAL_FIXED_BYTES`. The weights: ``params x param_bytes``, times
    :data:`GGUF_LOAD_FACTOR` for a GGUF (the peak while it is dequantized). The routers of a WIDE checkpoint are
    not counted (0.1-1% of the weights).

    Args:
        dims: the base model's shape.
        vocab_size: ``V``, the width of the logits.
        params: the base model's parameter count (:func:`config_param_count`).
        batch_size: windows per forward pass.
        ctx: tokens per window.
        param_bytes: bytes per weight (4 float32, 2 bfloat16).
        act_bytes: bytes per activation value (4 on CPU, 2 under CUDA's bfloat16 autocast).
        gguf: the weights come from a GGUF file.

    Returns:
        ``(weights, forward)`` bytes.
    """
    weights = int(params * param_bytes * (GGUF_LOAD_FACTOR if gguf else 1.0))
    kv = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim
    per_token = (layer_values(dims, ctx) + kv) * act_bytes + EVAL_LOGIT_BYTES * vocab_size
    return weights, int(batch_size * ctx * per_token + EVAL_FIXED_BYTES)


def check_eval_memory(hf_config, batch_size: int, ctx: int, device: torch.device | str, *,
                      gguf: bool = False, asked: int | None = None, ctx_flag: str = "--ctx", item: str = "window",
                      purpose: str = "evaluation") -> int | None:
    """Refuse an evaluation whose weights and forward pass would not fit in memory, before the weights load.

    Args:
        hf_config: the base model's Hugging Face config (weights not loaded yet).
        batch_size: windows per forward pass (at most the number of windows).
        ctx: tokens per window.
        device: where the model will run: CPU (float32 weights and activations) or CUDA (bfloat16).
        gguf: the weights come from a GGUF file (see :func:`estimate_eval_memory`).
        asked: the ``--batch-size`` given, when ``batch_size`` is that capped at the number of windows (the
            message then says so).
        ctx_flag, item, purpose: how the message names the length option, one sequence and the job (``wide
            prune-static`` scores groups on ``--seq-len`` calibration sequences with the same forward pass).

    Returns:
        the estimate in bytes, or None when the available memory cannot be told (then nothing is checked).

    Raises:
        WideError: the estimate exceeds :data:`HEADROOM` of the available memory; the message names the estimate
            (weights and forward pass), the memory available, a ``--batch-size`` (or ``--ctx``) that fits, and
            ``--no-memory-check``.
    """
    from wide.model import dims_of

    device = torch.device(device)
    got = available_memory(device)
    if got is None:
        return None
    avail, where = got
    dims, vocab = dims_of(hf_config), int(hf_config.vocab_size)
    nbytes = 2 if device.type == "cuda" else 4
    params = config_param_count(hf_config)

    def need(b: int, t: int) -> tuple[int, int]:
        return estimate_eval_memory(dims, vocab, params, b, t, param_bytes=nbytes, act_bytes=nbytes, gguf=gguf)

    weights, forward = need(batch_size, ctx)
    if weights + forward <= HEADROOM * avail:
        return weights + forward
    dtype = "float32" if nbytes == 4 else "bfloat16"
    tip = next((b for b in range(batch_size - 1, 0, -1) if sum(need(b, ctx)) <= HEADROOM * avail), None)
    if tip is not None:
        fix = f"use --batch-size {tip} (about {_gib(sum(need(tip, ctx)))})"
    else:
        t = ctx // 2
        while t >= 2 and sum(need(1, t)) > HEADROOM * avail:
            t //= 2
        note = "; shorter windows give a higher perplexity" if purpose == "evaluation" else ""
        fix = (f"use --batch-size 1 {ctx_flag} {t} (about {_gib(sum(need(1, t)))}{note})" if t >= 2 else
               f"the weights alone need {_gib(weights)}: use a machine or device with more memory")
    what = (f"all {batch_size} {item}{'s' if batch_size != 1 else ''} of the text (--batch-size {asked} is capped "
            f"at the number of {item}s)" if asked is not None and asked > batch_size else
            f"{batch_size} {item}{'s' if batch_size != 1 else ''} (--batch-size)")
    raise WideError(f"a forward pass of {what} x {ctx} tokens ({ctx_flag}) needs about "
                    f"{_gib(weights + forward)} for {purpose} ({_gib(weights)} for the {dtype} weights"
                    f"{' (the peak while they are dequantized from GGUF)' if gguf else ''} and {_gib(forward)} for the pass, of which "
                    f"{_gib(batch_size * ctx * vocab * EVAL_LOGIT_BYTES)} are the [{batch_size} x {ctx} x {vocab}] "
                    f"logits and their float32 loss; a conservative estimate), but "
                    f"{_gib(avail)} is available ({where}; at most {HEADROOM:.0%} of it is used): {fix}; or pass "
                    f"--no-memory-check to try anyway")
