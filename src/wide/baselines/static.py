"""Static width pruning (the static baseline family of §4.1): the same groups removed for every token, in WIDE's
units (Eq. 2-3: ``G_attn`` channels of the ``o_proj`` input, by default one KV head with its query heads; ``G_ffn``
channels of the ``down_proj`` input). Channel ``c`` of input ``x`` scores ``sqrt(sum_t x_tc^2) * ||W[:, c]||_2`` over
the calibration tokens (a structured Wanda score), a group the sum over its channels; every layer removes as many
of its lowest groups, so the result is an ordinary, smaller model. ``S`` is the mean removed fraction over the 2N
modules (Eq. 6); of the (attention, FFN) splits within half an FFN group of ``S`` the lowest calibration loss wins.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from wide.config import ModelDims, WideConfig, atomic_write_text, set_new_file_mode
from wide.errors import WideError
from wide.eval.perplexity import perplexity
from wide.model import WideModel, check_architecture, decoder_layers, dims_of

PRUNING_NAME = "static_pruning.json"


@torch.no_grad()
def group_scores(model: nn.Module, blocks: torch.Tensor, attn_group_size: int, ffn_group_size: int,
                 batch_size: int = 4, progress: bool = False) -> dict[str, torch.Tensor]:
    """Group importance (module docstring) over int64 ``blocks`` ``[N, T]``: float64 ``{"attn": [L, N_attn],
    "ffn": [L, N_ffn]}`` on the CPU; ``progress``: a progress bar over the batches."""
    layers = decoder_layers(model)
    sq = {"attn": [0.0] * len(layers), "ffn": [0.0] * len(layers)}
    def hook(kind, i):
        def f(module, args):
            sq[kind][i] = sq[kind][i] + args[0].detach().double().pow(2).flatten(0, -2).sum(0)
        return f
    handles = [lin.register_forward_pre_hook(hook(kind, i)) for i, layer in enumerate(layers)
               for kind, lin in (("attn", layer.self_attn.o_proj), ("ffn", layer.mlp.down_proj))]
    try:
        perplexity(model, blocks, batch_size, progress=progress, desc="scoring groups")  # the passes the hooks read
    finally:
        for h in handles:
            h.remove()
    out = {}
    for kind, g, proj in (("attn", attn_group_size, "self_attn.o_proj"), ("ffn", ffn_group_size, "mlp.down_proj")):
        w = [layer.get_submodule(proj).weight.detach().double().cpu().norm(dim=0) for layer in layers]
        out[kind] = torch.stack([(s.cpu().sqrt() * wn).view(-1, g).sum(-1) for s, wn in zip(sq[kind], w)])
    return out


@dataclass
class StaticPruning:
    """Which groups a static pruning keeps for every token: ``attn_keep`` / ``ffn_keep`` ``[L][N_G]`` bools (True =
    keep, the same count in every layer), for the requested ``target_sparsity``; ``model`` / ``fingerprint`` name the
    base model, ``calib`` holds facts about the calibration."""

    attn_keep: list
    ffn_keep: list
    attn_group_size: int
    ffn_group_size: int
    target_sparsity: float
    model: str = ""
    fingerprint: str = ""
    score: str = "act_l2_x_weight_col_norm"
    calib: dict = field(default_factory=dict)

    attn_sparsity = property(lambda self: 1.0 - sum(map(sum, self.attn_keep)) / sum(map(len, self.attn_keep)))
    ffn_sparsity = property(lambda self: 1.0 - sum(map(sum, self.ffn_keep)) / sum(map(len, self.ffn_keep)))

    sparsity = property(lambda self: 0.5 * (self.attn_sparsity + self.ffn_sparsity))  # over the 2N modules (Eq. 6)

    def apply(self, base: nn.Module) -> WideModel:
        """A WideModel on ``base`` with these masks fixed (bool ``[L, 1, 1, N_G]``; routers unused); WideError for
        groups that do not fit ``base``."""
        wm = WideModel(base, WideConfig(attn_group_size=self.attn_group_size, ffn_group_size=self.ffn_group_size,
                                        target_sparsity=min(self.target_sparsity, 0.999)))
        if (len(self.attn_keep), wm.n_attn_groups, wm.n_ffn_groups) != \
                (wm.dims.num_layers, len(self.attn_keep[0]), len(self.ffn_keep[0])):
            raise WideError(f"static pruning with {len(self.attn_keep)} layers x ({len(self.attn_keep[0])}, "
                            f"{len(self.ffn_keep[0])}) groups does not fit this model")
        wm.fixed_masks = {k: torch.tensor(v, dtype=torch.bool)[:, None, None, :]
                          for k, v in (("attn", self.attn_keep), ("ffn", self.ffn_keep))}
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
        """Read ``static_pruning.json`` from ``directory`` (WideError when missing or corrupt)."""
        path = Path(directory) / PRUNING_NAME
        if not path.is_file():
            raise WideError(f"no {PRUNING_NAME} in {str(directory)!r}: not a `wide prune-static` output")
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError) as e:
            raise WideError(f"corrupt {path}: {e}") from None


def closest_pairs(n_attn: int, n_ffn: int, sparsity: float) -> list[tuple[int, int]]:
    """(attention, FFN) groups removed per layer whose mean removed fraction is within half an FFN group of
    ``sparsity`` (or the closest there is); at least one group of each kind stays."""
    best = {}
    for pa in range(n_attn):
        pf = min(max(round((2 * sparsity - pa / n_attn) * n_ffn), 0), n_ffn - 1)
        best[pa] = (abs(0.5 * (pa / n_attn + pf / n_ffn) - sparsity), pf)
    tol = max(0.25 / n_ffn, min(e for e, _ in best.values())) + 1e-9
    return [(pa, pf) for pa, (e, pf) in best.items() if e <= tol]


def keep_lowest(scores: torch.Tensor, n_remove: int) -> list[list[bool]]:
    """Per row of ``scores`` ``[L, N]``, keep all but the ``n_remove`` lowest (ties: lower index removed first)."""
    keep = torch.ones(scores.shape, dtype=torch.bool)
    keep.scatter_(1, torch.argsort(scores, dim=1, stable=True)[:, :n_remove], False)
    return keep.tolist()


def check_group_sizes(dims: ModelDims, attn_group_size: int | None, ffn_group_size: int) -> int:
    """The attention group size (None: the GQA group), checked with the FFN one against ``dims``; WideError for
    an attention size that is not a multiple of the GQA group dividing the attention width (whole KV heads are
    removed) or a bad FFN size, listing the legal ones."""
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
          ffn_sparsity: float | None = None, select_blocks: int = 4, progress: bool = False) -> StaticPruning:
    """Score the groups of a dense HF causal LM on int64 ``blocks`` ``[N, T]`` and choose the static pruning for
    target ``S`` in [0, 1) (module docstring); ``attn_sparsity`` / ``ffn_sparsity`` fix the split instead (both
    or neither, rounded to whole groups); the split's LM loss is measured on the first ``select_blocks`` blocks.
    ``progress``: progress bars over the scoring and over each candidate split.  Raises WideError for bad group
    sizes or sparsities."""
    check_architecture(model.config)
    g_a = check_group_sizes(dims_of(model.config), attn_group_size, ffn_group_size)
    WideConfig(target_sparsity=sparsity)
    if (attn_sparsity is None) != (ffn_sparsity is None):
        raise WideError("give both --attn-sparsity and --ffn-sparsity, or neither")
    scores = group_scores(model, blocks, g_a, ffn_group_size, batch_size, progress)
    n_a, n_f = scores["attn"].shape[1], scores["ffn"].shape[1]
    if attn_sparsity is not None:
        pairs = [(min(round(attn_sparsity * n_a), n_a - 1), min(round(ffn_sparsity * n_f), n_f - 1))]
    else:
        pairs = closest_pairs(n_a, n_f, sparsity)
    cands = [StaticPruning(keep_lowest(scores["attn"], pa), keep_lowest(scores["ffn"], pf), g_a, ffn_group_size,
                           float(sparsity)) for pa, pf in pairs]
    best = cands[0]
    if len(cands) > 1:
        losses = []
        for k, c in enumerate(cands):
            wm = c.apply(model)
            try:
                losses.append(perplexity(wm, blocks[:select_blocks], batch_size, progress=progress,
                                         desc=f"split {k + 1}/{len(cands)}")["nll"])
            finally:
                for h in wm._handles:  # detach the routing hooks from the base model
                    h.remove()
        best = cands[min(range(len(cands)), key=losses.__getitem__)]
        best.calib["allocation_losses"] = {f"attn {c.attn_sparsity:.3f} / ffn {c.ffn_sparsity:.3f}": loss
                                           for c, loss in zip(cands, losses)}
    best.calib.update({"blocks": int(blocks.shape[0]), "seq_len": int(blocks.shape[1])})
    return best


def _linear(lin: nn.Linear, idx: torch.Tensor, dim: int) -> nn.Linear:
    """A copy of ``lin`` keeping the output rows (``dim=0``) or input columns (``dim=1``) ``idx``."""
    w = lin.weight.detach().index_select(dim, idx.to(lin.weight.device))
    new = nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None, device=w.device, dtype=w.dtype)
    new.weight.data.copy_(w)
    if lin.bias is not None:
        new.bias.data.copy_(lin.bias.detach()[idx] if dim == 0 else lin.bias.detach())
    return new


def _channels(keep: list[bool], group: int) -> torch.Tensor:
    return torch.tensor([g * group + c for g, k in enumerate(keep) if k for c in range(group)], dtype=torch.long)


def slice_model(model: nn.Module, pruning: StaticPruning) -> nn.Module:
    """A physically smaller copy of ``model`` (unchanged) without the pruned groups: ``q_proj`` rows and
    ``o_proj`` columns of the removed query heads, ``k_proj`` / ``v_proj`` rows of their KV heads, ``gate_proj`` /
    ``up_proj`` rows and ``down_proj`` columns of the removed FFN channels; the config follows. A GGUF-loaded
    model's copy is a plain float checkpoint. Returns a new model (same class, dtype, device; eval, frozen);
    WideError for a pruning that does not fit the model or keeps another (or no) number of groups in some layer."""
    arch = check_architecture(model.config)
    dims = dims_of(model.config)
    ga, gf = pruning.attn_group_size, pruning.ffn_group_size
    ka, kf = {sum(r) for r in pruning.attn_keep}, {sum(r) for r in pruning.ffn_keep}
    if len(ka) != 1 or len(kf) != 1 or 0 in ka or 0 in kf:
        raise WideError("physical slicing needs the same, non-zero number of kept groups in every layer")
    if (ga % dims.gqa_group_size or dims.attn_width % ga or dims.intermediate_size % gf
            or len(pruning.attn_keep) != dims.num_layers or len(pruning.ffn_keep) != dims.num_layers):
        raise WideError(f"static pruning of {len(pruning.attn_keep)} layers, groups ({ga}, {gf}), does not fit this "
                        f"model ({dims.num_layers} layers)")
    kv_per_group, q_per_kv = ga // dims.gqa_group_size, dims.num_heads // dims.num_kv_heads
    new = copy.deepcopy(model)  # its modules share one config object, changed in place below
    if getattr(new, "hf_quantizer", None) is not None:  # a GGUF load is dequantized: the copy holds plain floats
        new.hf_quantizer.remove_quantization_config(new)
    cfg = new.config
    cfg.num_key_value_heads = ka.pop() * kv_per_group
    cfg.num_attention_heads = cfg.num_key_value_heads * q_per_kv
    cfg.head_dim, cfg.intermediate_size, cfg.architectures = dims.head_dim, kf.pop() * gf, [arch]
    for layer, akeep, fkeep in zip(decoder_layers(new), pruning.attn_keep, pruning.ffn_keep):
        attn, mlp = layer.self_attn, layer.mlp
        q_idx = _channels(akeep, ga)
        kv_idx = _channels([k for k in akeep for _ in range(kv_per_group)], dims.head_dim)
        attn.q_proj, attn.o_proj = _linear(attn.q_proj, q_idx, 0), _linear(attn.o_proj, q_idx, 1)
        attn.k_proj, attn.v_proj = _linear(attn.k_proj, kv_idx, 0), _linear(attn.v_proj, kv_idx, 0)
        attn.num_key_value_groups = q_per_kv
        f_idx = _channels(fkeep, gf)
        mlp.gate_proj, mlp.up_proj = _linear(mlp.gate_proj, f_idx, 0), _linear(mlp.up_proj, f_idx, 0)
        mlp.down_proj = _linear(mlp.down_proj, f_idx, 1)
        mlp.intermediate_size = cfg.intermediate_size
    new.eval()
    new.requires_grad_(False)
    return new


def param_count(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_pruned(model: nn.Module, tokenizer, pruning: StaticPruning, directory: str | os.PathLike) -> Path:
    """Write the sliced model (``save_pretrained``), its tokenizer and ``static_pruning.json`` into ``directory``,
    usable as ``--model``; every file written gets a new file's mode (safetensors writes 0600)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    before = {f.name: f.stat().st_ino for f in directory.iterdir() if f.is_file()}
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    pruning.save(directory)
    set_new_file_mode(f for f in directory.iterdir() if f.is_file() and before.get(f.name) != f.stat().st_ino)
    return directory
