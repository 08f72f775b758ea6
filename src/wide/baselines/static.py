"""Static width pruning: the same GQA head groups and FFN channel groups removed for every token.

The static-width baseline of the WIDE comparison (§4.1 compares against static width pruning such as
SliceGPT / DDP; this is a simple, calibration-scored member of that family). Units are those of WIDE
(Eq. 2-3): attention groups of ``G_attn`` channels of the ``o_proj`` input (default the GQA group, i.e.
one KV head with its query heads) and FFN groups of ``G_ffn`` channels of the ``down_proj`` input.

Importance (activation magnitude x weight norm, a structured form of Wanda's score): over the
calibration tokens ``t``, channel ``c`` of a projection input ``x`` scores
``sqrt(sum_t x_{t,c}^2) * ||W[:, c]||_2`` (``W`` = ``o_proj`` / ``down_proj`` weight); a group scores the
sum over its channels. Every layer removes the same number of attention groups and of FFN groups (its
lowest scored ones), so the pruned model is an ordinary, smaller Llama-family model (fewer heads and KV
heads, smaller intermediate size) with the same config in every layer.

Allocation: ``S`` is matched as the mean over the ``2N`` modules of the pruned fraction, as in Eq. 6.
With few attention groups (SmolLM2: 3 per layer) several (attention, FFN) splits reach ``S`` about
equally well; among the splits within half an FFN group of ``S`` the one with the lowest calibration LM
loss is taken (:func:`choose_allocation`). ``attn_sparsity`` / ``ffn_sparsity`` fix the split by hand.

Two equivalent forms (tested to give equal logits): a fixed mask on :class:`wide.model.WideModel`
(:meth:`StaticPruning.apply`) and a physically sliced model (:func:`slice_model`), whose speed is real.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from wide.config import ModelDims, WideConfig, atomic_write_text, set_new_file_mode
from wide.errors import WideError

PRUNING_NAME = "static_pruning.json"


# --- importance -----------------------------------------------------------------------------------
@torch.no_grad()
def channel_sq_norms(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """Per-channel sum of squares of the ``o_proj`` and ``down_proj`` inputs over calibration tokens.

    Args:
        model: a supported HF causal LM (dense; eval mode).
        blocks: int64 ``[N, T]`` token blocks (:func:`wide.data.pack`).
        batch_size: blocks per forward pass, ``>= 1``.

    Returns:
        ``{"attn": float64 [L, H_q*head_dim], "ffn": float64 [L, D']}`` (CPU), summed over all N*T tokens.

    Raises:
        WideError: empty ``blocks`` or ``batch_size < 1``.
    """
    from wide.model import decoder_layers

    if blocks.ndim != 2 or blocks.shape[0] < 1:
        raise WideError(f"calibration blocks must be a non-empty [N, T] tensor, got shape {tuple(blocks.shape)}")
    if batch_size < 1:
        raise WideError(f"batch size {batch_size} must be >= 1")
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    acc = {"attn": [None] * len(layers), "ffn": [None] * len(layers)}

    def hook(kind, i):
        def f(module, args):
            x = args[0].detach().double()
            s = x.pow(2).flatten(0, -2).sum(0)
            acc[kind][i] = s if acc[kind][i] is None else acc[kind][i] + s
        return f

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(hook("attn", i)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(hook("ffn", i)))
    was = model.training
    model.eval()
    try:
        for b in range(0, blocks.shape[0], batch_size):
            ids = blocks[b:b + batch_size].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return {k: torch.stack([t.cpu() for t in v]) for k, v in acc.items()}


def group_scores(model: nn.Module, sq: dict[str, torch.Tensor], attn_group_size: int,
                 ffn_group_size: int) -> dict[str, torch.Tensor]:
    """Group importance ``sum_{c in g} sqrt(sq_c) * ||W[:, c]||_2`` from :func:`channel_sq_norms` output.

    Returns:
        ``{"attn": float64 [L, N_attn], "ffn": float64 [L, N_ffn]}``.
    """
    from wide.model import decoder_layers

    out = {"attn": [], "ffn": []}
    for i, layer in enumerate(decoder_layers(model)):
        for kind, lin, g in (("attn", layer.self_attn.o_proj, attn_group_size),
                             ("ffn", layer.mlp.down_proj, ffn_group_size)):
            w = lin.weight.detach().double().cpu().norm(dim=0)  # [in]
            s = sq[kind][i].sqrt() * w
            out[kind].append(s.view(-1, g).sum(-1))
    return {k: torch.stack(v) for k, v in out.items()}


# --- the pruning ----------------------------------------------------------------------------------
@dataclass
class StaticPruning:
    """Which groups a static pruning keeps (True = keep), the same for every token.

    Attributes:
        attn_keep: ``[L][N_attn]`` bools; every layer keeps the same number.
        ffn_keep: ``[L][N_ffn]`` bools; every layer keeps the same number.
        attn_group_size, ffn_group_size: ``G`` in channels (attention: a multiple of the GQA group).
        target_sparsity: the requested ``S``.
        model: the base model's ``--model`` reference; fingerprint: its weight fingerprint.
        score: the importance score's name; calib: facts about the calibration data (free form).
    """

    attn_keep: list
    ffn_keep: list
    attn_group_size: int
    ffn_group_size: int
    target_sparsity: float
    model: str = ""
    fingerprint: str = ""
    score: str = "act_l2_x_weight_col_norm"
    calib: dict = field(default_factory=dict)

    @property
    def attn_sparsity(self) -> float:
        """Fraction of attention groups removed (same in every layer)."""
        return 1.0 - sum(map(sum, self.attn_keep)) / sum(map(len, self.attn_keep))

    @property
    def ffn_sparsity(self) -> float:
        """Fraction of FFN groups removed (same in every layer)."""
        return 1.0 - sum(map(sum, self.ffn_keep)) / sum(map(len, self.ffn_keep))

    @property
    def sparsity(self) -> float:
        """Mean over the 2N modules of the removed fraction (the quantity Eq. 6 targets)."""
        return 0.5 * (self.attn_sparsity + self.ffn_sparsity)

    def masks(self) -> dict[str, torch.Tensor]:
        """Fixed masks for :attr:`wide.model.WideModel.fixed_masks`: bool ``[L, 1, 1, N_G]`` each."""
        return {"attn": torch.tensor(self.attn_keep, dtype=torch.bool)[:, None, None, :],
                "ffn": torch.tensor(self.ffn_keep, dtype=torch.bool)[:, None, None, :]}

    def wide_config(self) -> WideConfig:
        """The :class:`WideConfig` whose group sizes these masks use (routers unused)."""
        return WideConfig(attn_group_size=self.attn_group_size, ffn_group_size=self.ffn_group_size,
                          target_sparsity=min(self.target_sparsity, 0.999))

    def apply(self, base: nn.Module):
        """A :class:`wide.model.WideModel` on ``base`` with these masks fixed (the fixed-mask form).

        Raises:
            WideError: group sizes that do not fit ``base``.
        """
        from wide.model import WideModel

        wm = WideModel(base, self.wide_config())
        if (wm.n_attn_groups, wm.n_ffn_groups) != (len(self.attn_keep[0]), len(self.ffn_keep[0])) or \
                len(self.attn_keep) != wm.dims.num_layers:
            raise WideError(f"static pruning with {len(self.attn_keep)} layers x ({len(self.attn_keep[0])}, "
                            f"{len(self.ffn_keep[0])}) groups does not fit this model")
        wm.fixed_masks = self.masks()
        return wm

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``static_pruning.json`` into ``directory`` (atomically)."""
        path = Path(directory) / PRUNING_NAME
        data = {**asdict(self), "attn_sparsity": self.attn_sparsity, "ffn_sparsity": self.ffn_sparsity,
                "sparsity": self.sparsity, "method": "static"}
        atomic_write_text(path, json.dumps(data, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> StaticPruning:
        """Read ``static_pruning.json`` from ``directory``.

        Raises:
            WideError: missing or corrupt file.
        """
        path = Path(directory) / PRUNING_NAME
        if not path.is_file():
            raise WideError(f"no {PRUNING_NAME} in {str(directory)!r}: not a `wide prune-static` output")
        try:
            data = json.loads(path.read_text())
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            return cls(**known)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError) as e:
            raise WideError(f"corrupt {path}: {e}") from None


def _closest_pairs(n_attn: int, n_ffn: int, sparsity: float) -> list[tuple[int, int]]:
    """(attention, FFN) groups removed per layer whose mean removed fraction is within half an FFN group
    (or the best available) of ``sparsity``; at least one group of each kind stays."""
    best = {}
    for pa in range(n_attn):
        pf = min(max(round((2 * sparsity - pa / n_attn) * n_ffn), 0), n_ffn - 1)
        best[pa] = (abs(0.5 * (pa / n_attn + pf / n_ffn) - sparsity), pf)
    tol = max(0.5 / n_ffn * 0.5, min(e for e, _ in best.values())) + 1e-9
    return [(pa, pf) for pa, (e, pf) in best.items() if e <= tol]


def keep_lowest(scores: torch.Tensor, n_remove: int) -> list[list[bool]]:
    """Per row, keep everything but the ``n_remove`` lowest scores (ties: lower index removed first).

    Args:
        scores: ``[L, N]`` importance scores.
        n_remove: groups removed per row, ``0 <= n_remove < N``.

    Returns:
        ``[L][N]`` bools, True = keep.
    """
    L, n = scores.shape
    if not 0 <= n_remove < n:
        raise WideError(f"cannot remove {n_remove} of {n} groups per layer (need 0 <= k < {n})")
    keep = torch.ones(L, n, dtype=torch.bool)
    if n_remove:
        idx = torch.argsort(scores, dim=1, stable=True)[:, :n_remove]
        keep.scatter_(1, idx, False)
    return keep.tolist()


def remove_hooks(wm) -> None:
    """Detach a :class:`wide.model.WideModel`'s routing hooks from its base model."""
    for h in wm._handles:
        h.remove()
    wm._handles = []


@torch.no_grad()
def lm_loss(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """Mean next-token cross entropy (nats/token) of ``model`` (a HF LM or a WideModel) over ``blocks``."""
    device = next(model.parameters()).device
    tot, n = 0.0, 0
    for b in range(0, blocks.shape[0], batch_size):
        ids = blocks[b:b + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(ids).logits
        tot += float(nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                 reduction="sum"))
        n += ids[:, 1:].numel()
    return tot / n


def choose_allocation(model: nn.Module, scores: dict[str, torch.Tensor], sparsity: float, attn_group_size: int,
                      ffn_group_size: int, blocks: torch.Tensor | None = None, batch_size: int = 4,
                      attn_sparsity: float | None = None, ffn_sparsity: float | None = None) -> StaticPruning:
    """Pick the groups to remove (see the module docstring).

    Args:
        model: the dense base model.
        scores: :func:`group_scores` output.
        sparsity: target ``S`` in ``[0, 1)``: mean over modules of the removed fraction.
        attn_group_size, ffn_group_size: group sizes used by ``scores``.
        blocks: calibration blocks used to break ties between allocations by LM loss (if several qualify).
        attn_sparsity, ffn_sparsity: fix the per-module fractions instead (both or neither; each rounded
            to whole groups per layer).

    Returns:
        a :class:`StaticPruning` (``model``/``fingerprint`` left empty).

    Raises:
        WideError: ``S`` outside ``[0, 1)``, only one of the two overrides, or overrides outside ``[0, 1)``.
    """
    if not (isinstance(sparsity, (int, float)) and 0.0 <= sparsity < 1.0) or math.isnan(sparsity):
        raise WideError(f"target sparsity S={sparsity!r} is outside [0, 1)")
    n_a, n_f = scores["attn"].shape[1], scores["ffn"].shape[1]
    if (attn_sparsity is None) != (ffn_sparsity is None):
        raise WideError("give both --attn-sparsity and --ffn-sparsity, or neither")
    if attn_sparsity is not None:
        for name, v in (("attention", attn_sparsity), ("FFN", ffn_sparsity)):
            if not 0.0 <= v < 1.0:
                raise WideError(f"{name} sparsity {v!r} is outside [0, 1)")
        pairs = [(min(round(attn_sparsity * n_a), n_a - 1), min(round(ffn_sparsity * n_f), n_f - 1))]
    else:
        pairs = _closest_pairs(n_a, n_f, sparsity)

    def make(pa, pf):
        return StaticPruning(keep_lowest(scores["attn"], pa), keep_lowest(scores["ffn"], pf), attn_group_size,
                             ffn_group_size, float(sparsity))

    cands = [make(pa, pf) for pa, pf in pairs]
    if len(cands) == 1 or blocks is None:
        return cands[0]
    losses = []
    for c in cands:
        wm = c.apply(model)
        try:
            losses.append(lm_loss(wm, blocks, batch_size))
        finally:
            remove_hooks(wm)
    best = min(range(len(cands)), key=lambda k: losses[k])
    cands[best].calib["allocation_losses"] = {f"attn {c.attn_sparsity:.3f} / ffn {c.ffn_sparsity:.3f}": l
                                              for c, l in zip(cands, losses)}
    return cands[best]


def check_group_sizes(dims: ModelDims, attn_group_size: int | None, ffn_group_size: int) -> int:
    """Check static pruning's group sizes against a model's dims (e.g. read from its config, before its weights).

    Args:
        dims: the model's shape.
        attn_group_size: a multiple of the GQA group ``H_q/H_k * head_dim`` dividing the attention width, or None
            for the GQA group.
        ffn_group_size: FFN ``G``, a power of two ``>= 16`` dividing the FFN size.

    Returns:
        the attention group size (the GQA group for None).

    Raises:
        WideError: a group size that does not fit; the message lists the legal ones.
    """
    g_a = dims.gqa_group_size if attn_group_size is None else int(attn_group_size)
    legal = [g for g in range(dims.gqa_group_size, dims.attn_width + 1, dims.gqa_group_size)
             if dims.attn_width % g == 0]
    if g_a not in legal:
        raise WideError(f"static attention group size G={g_a} must be a multiple of the GQA group "
                        f"{dims.gqa_group_size} dividing the attention width {dims.attn_width} (whole KV heads "
                        f"are removed); legal: {legal}")
    WideConfig(attn_group_size=g_a, ffn_group_size=ffn_group_size).resolve(dims)
    return g_a


def prune(model: nn.Module, blocks: torch.Tensor, sparsity: float, attn_group_size: int | None = None,
          ffn_group_size: int = 128, batch_size: int = 4, attn_sparsity: float | None = None,
          ffn_sparsity: float | None = None, select_blocks: int = 4) -> StaticPruning:
    """Score groups on ``blocks`` and choose the static pruning for target ``S`` (module docstring).

    Args:
        model: a supported dense HF causal LM.
        blocks: int64 ``[N, T]`` calibration token blocks.
        sparsity: target ``S`` in ``[0, 1)``.
        attn_group_size: a multiple of the GQA group ``H_q/H_k * head_dim`` dividing the attention width
            (default: the GQA group); whole groups are removed with their KV heads.
        ffn_group_size: FFN ``G`` (power of two ``>= 16`` dividing the FFN size).
        batch_size: blocks per forward pass.
        attn_sparsity, ffn_sparsity: optional fixed split (see :func:`choose_allocation`).
        select_blocks: how many of ``blocks`` the allocation choice evaluates the LM loss on.

    Returns:
        a :class:`StaticPruning`.

    Raises:
        WideError: bad group sizes or sparsity values, empty ``blocks``.
    """
    from wide.model import check_architecture, dims_of

    check_architecture(model.config)
    g_a = check_group_sizes(dims_of(model.config), attn_group_size, ffn_group_size)
    sq = channel_sq_norms(model, blocks, batch_size)
    scores = group_scores(model, sq, g_a, ffn_group_size)
    sel = blocks[:max(1, select_blocks)]
    p = choose_allocation(model, scores, sparsity, g_a, ffn_group_size, blocks=sel, batch_size=batch_size,
                          attn_sparsity=attn_sparsity, ffn_sparsity=ffn_sparsity)
    p.calib.update({"blocks": int(blocks.shape[0]), "seq_len": int(blocks.shape[1])})
    return p


# --- physical slicing -----------------------------------------------------------------------------
def _rows(lin: nn.Linear, idx: torch.Tensor) -> nn.Linear:
    new = nn.Linear(lin.in_features, len(idx), bias=lin.bias is not None, device=lin.weight.device,
                    dtype=lin.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(lin.weight[idx])
        if lin.bias is not None:
            new.bias.copy_(lin.bias[idx])
    return new


def _cols(lin: nn.Linear, idx: torch.Tensor) -> nn.Linear:
    new = nn.Linear(len(idx), lin.out_features, bias=lin.bias is not None, device=lin.weight.device,
                    dtype=lin.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(lin.weight[:, idx])
        if lin.bias is not None:
            new.bias.copy_(lin.bias)
    return new


def _channels(keep: list[bool], group: int) -> torch.Tensor:
    return torch.tensor([g * group + c for g, k in enumerate(keep) if k for c in range(group)], dtype=torch.long)


def slice_model(model: nn.Module, pruning: StaticPruning) -> nn.Module:
    """A physically smaller copy of ``model`` with the pruned groups removed (``model`` is unchanged).

    Per layer: ``q_proj`` rows and ``o_proj`` columns of the removed query heads, ``k_proj`` / ``v_proj``
    rows of their KV heads (used by no remaining query head), ``gate_proj`` / ``up_proj`` rows and
    ``down_proj`` columns of the removed FFN channels. The config gets ``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size`` and an explicit ``head_dim``; its output equals the
    fixed-mask form's (:meth:`StaticPruning.apply`). A model loaded from GGUF (dequantized by transformers) is
    saved as a plain float checkpoint (its GGUF quantizer marker is dropped from the copy).

    Args:
        model: the dense HF causal LM the pruning was made for.
        pruning: a :class:`StaticPruning` with the same kept count in every layer.

    Returns:
        a new ``*ForCausalLM`` (same class, dtype and device), eval mode, ``requires_grad=False``.

    Raises:
        WideError: layer counts that differ, or a pruning that does not fit the model.
    """
    from wide.model import check_architecture, decoder_layers, dims_of

    arch = check_architecture(model.config)
    dims: ModelDims = dims_of(model.config)
    ga, gf = pruning.attn_group_size, pruning.ffn_group_size
    if ga % dims.gqa_group_size or dims.attn_width % ga or dims.intermediate_size % gf:
        raise WideError(f"static pruning groups ({ga}, {gf}) do not fit this model")
    if len(pruning.attn_keep) != dims.num_layers or len(pruning.ffn_keep) != dims.num_layers:
        raise WideError(f"static pruning has {len(pruning.attn_keep)} layers, the model {dims.num_layers}")
    ka = {sum(r) for r in pruning.attn_keep}
    kf = {sum(r) for r in pruning.ffn_keep}
    if len(ka) != 1 or len(kf) != 1 or 0 in ka or 0 in kf:
        raise WideError("physical slicing needs the same, non-zero number of kept groups in every layer")
    kv_per_group = ga // dims.gqa_group_size
    q_per_kv = dims.num_heads // dims.num_kv_heads
    cfg = copy.deepcopy(model.config)
    cfg.num_key_value_heads = ka.pop() * kv_per_group
    cfg.num_attention_heads = cfg.num_key_value_heads * q_per_kv
    cfg.head_dim = dims.head_dim
    cfg.intermediate_size = kf.pop() * gf
    cfg.architectures = [arch]
    if hasattr(cfg, "quantization_config"):  # a GGUF load is dequantized: the copy holds plain float weights
        del cfg.quantization_config
    new = copy.deepcopy(model)
    if getattr(new, "hf_quantizer", None) is not None:
        new.hf_quantizer = None
        for attr in ("is_quantized", "quantization_method"):
            if hasattr(new, attr):
                try:
                    setattr(new, attr, False if attr == "is_quantized" else None)
                except AttributeError:  # a read-only property derived from hf_quantizer
                    pass
    new.config = cfg
    if hasattr(new, "model") and hasattr(new.model, "config"):
        new.model.config = cfg
    hd = dims.head_dim
    for layer, akeep, fkeep in zip(decoder_layers(new), pruning.attn_keep, pruning.ffn_keep):
        attn, mlp = layer.self_attn, layer.mlp
        q_idx = _channels(akeep, ga)                                   # query channels kept
        kv_keep = [k for k in akeep for _ in range(kv_per_group)]      # per KV head
        kv_idx = _channels(kv_keep, hd)
        attn.q_proj = _rows(attn.q_proj, q_idx)
        attn.k_proj = _rows(attn.k_proj, kv_idx)
        attn.v_proj = _rows(attn.v_proj, kv_idx)
        attn.o_proj = _cols(attn.o_proj, q_idx)
        attn.config = cfg
        if hasattr(attn, "num_key_value_groups"):
            attn.num_key_value_groups = q_per_kv
        f_idx = _channels(fkeep, gf)
        mlp.gate_proj = _rows(mlp.gate_proj, f_idx)
        mlp.up_proj = _rows(mlp.up_proj, f_idx)
        mlp.down_proj = _cols(mlp.down_proj, f_idx)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = cfg.intermediate_size
        if hasattr(mlp, "config"):
            mlp.config = cfg
    new.eval()
    new.requires_grad_(False)
    return new


def param_count(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_pruned(model: nn.Module, tokenizer, pruning: StaticPruning, directory: str | os.PathLike) -> Path:
    """Write the sliced model (``save_pretrained``: ``config.json`` + safetensors), its tokenizer and
    ``static_pruning.json`` into ``directory``; the folder then works as ``--model DIR``.

    Args:
        model: the output of :func:`slice_model`.
        tokenizer: the base model's tokenizer.
        pruning: the pruning it was made with.
        directory: output folder (created).

    Every file written gets the mode of a newly created file (``0o666 & ~umask``), the weights too.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    before = {f.name: f.stat().st_ino for f in directory.iterdir() if f.is_file()}
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    pruning.save(directory)
    # the files just created (new names or replaced inodes) get a new file's mode; safetensors writes 0600
    set_new_file_mode(f for f in directory.iterdir() if f.is_file() and before.get(f.name) != f.stat().st_ino)
    return directory
