"""Stage-2 LoRA (paper §3.2, §4.1) with peft on all seven projections of every layer. peft replaces them in place, so
the routing hooks are installed again: the gates then gate the input of both the base and the LoRA path (Eq. 2-3)."""

from __future__ import annotations

import math
import os
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from wide.config import ModelDims, replace_dir, set_new_file_mode
from wide.errors import WideError, first_line
from wide.model import WideModel
from wide.routing import keyed_uniform

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_DIR = "adapter"
_PEFT_ATTR = "_wide_peft_model"  # a plain attribute (not a submodule) holding the PeftModel


def max_lora_rank(dims: ModelDims) -> tuple[int, list[str]]:
    """The largest useful rank, ``min(in, out)`` over the seven projections, and the projections that set it."""
    d, q, kv, i = dims.hidden_size, dims.attn_width, dims.num_kv_heads * dims.head_dim, dims.intermediate_size
    sides = dict(zip(LORA_TARGETS, (min(d, q), min(d, kv), min(d, kv), min(q, d), min(d, i), min(d, i), min(i, d))))
    limit = min(sides.values())
    return limit, [n for n, v in sides.items() if v == limit]


@dataclass
class LoraSettings:
    """LoRA rank ``r``, ``alpha`` (peft scales the update by ``alpha / r``) and input dropout (§4.1: 16, 32, 0.1)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.1

    def validate(self) -> None:
        """Raises WideError for ``r < 1``, ``alpha <= 0`` or a dropout outside ``[0, 1)``."""
        if not isinstance(self.r, int) or self.r < 1:
            raise WideError(f"--lora-r {self.r!r} must be a positive integer")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise WideError(f"--lora-alpha {self.alpha!r} must be > 0")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise WideError(f"--lora-dropout {self.dropout!r} must be in [0, 1)")

    def check_dims(self, dims: ModelDims) -> None:
        """Raises WideError for a rank above :func:`max_lora_rank`, before any adapter is built."""
        limit, names = max_lora_rank(dims)
        if self.r > limit:
            raise WideError(f"--lora-r {self.r} must be at most {limit}, the smaller side (min(in, out)) of the "
                            f"LoRA target {' / '.join(names)} of this model; a higher rank adds parameters but "
                            f"no capacity (the paper uses 16)")

    def to_dict(self) -> dict:
        return asdict(self)


class KeyedDropout(torch.nn.Module):
    """Inverted dropout on the LoRA input whose mask depends on (seed, sample, module) only, inside
    :func:`wide.routing.sample_keyed` (training); plain dropout elsewhere in train mode; identity in eval mode."""

    def __init__(self, p: float, name: str) -> None:
        super().__init__()
        self.p, self.name = float(p), name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, in]`` -> same shape and dtype."""
        if not self.training or self.p == 0.0:
            return x
        u = keyed_uniform(x.shape, x.device, ("lora_dropout", self.name))
        if u is None:
            return torch.nn.functional.dropout(x, self.p, True)
        return x * (u >= self.p).to(x.dtype) / (1.0 - self.p)


def use_keyed_dropout(wm: WideModel) -> None:
    """Replace peft's ``nn.Dropout`` on every LoRA input by :class:`KeyedDropout` of the same ``p``."""
    for name, mod in wm.base.named_modules():
        drops = getattr(mod, "lora_dropout", None)
        if isinstance(drops, torch.nn.ModuleDict):
            for adapter, d in list(drops.items()):
                if isinstance(d, torch.nn.Dropout):
                    drops[adapter] = KeyedDropout(d.p, name)


def _import_peft():
    try:
        import peft
    except ImportError:
        raise WideError("LoRA recovery needs peft: pip install 'wide[quality]' (peft==0.21.2)") from None
    return peft


def peft_model(wm: WideModel):
    """The ``peft.PeftModel`` wrapping ``wm.base`` (after :func:`attach_lora` / unmerged :func:`load_adapter`)."""
    return wm.__dict__.get(_PEFT_ATTR)


def attach_lora(wm: WideModel, settings: LoraSettings | None = None):
    """Inject fresh adapters (``lora_B = 0``: the output is unchanged), base frozen, routers as they were, and
    re-install the routing hooks; returns the ``peft.PeftModel``. Raises WideError for bad settings, a missing peft
    or an adapter already there."""
    peft = _import_peft()
    settings = settings or LoraSettings()
    settings.validate()
    settings.check_dims(wm.dims)
    if peft_model(wm) is not None or any("lora_" in n for n, _ in wm.base.named_parameters()):
        raise WideError("this model already has a LoRA adapter")
    flags = [p.requires_grad for p in wm.router_parameters()]
    pm = peft.get_peft_model(wm.base, peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha,
                                                      lora_dropout=settings.dropout,
                                                      target_modules=list(LORA_TARGETS), bias="none"))
    for p, f in zip(wm.router_parameters(), flags):
        p.requires_grad_(f)
    wm.__dict__[_PEFT_ATTR] = pm
    wm.install_hooks()
    return pm


def lora_named_parameters(wm: WideModel) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name in wm.base, parameter)`` of every LoRA weight (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``)."""
    return [(n, p) for n, p in wm.base.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def save_adapter(wm: WideModel, directory: str | os.PathLike, state: dict | None = None) -> Path:
    """Save the adapter with peft's ``save_pretrained`` into a temporary folder swapped into ``directory``; ``state``:
    the full LoRA weights ``{"base_model.model.<name>": tensor}`` (default ``wm``'s; a sharded model's are gathered
    by the caller). Raises WideError when ``wm`` has no adapter."""
    pm = peft_model(wm)
    if pm is None:
        raise WideError("this model has no LoRA adapter to save")
    if state is None:
        state = {f"base_model.model.{n}": p.detach().cpu().contiguous() for n, p in lora_named_parameters(wm)}
    directory = Path(directory)
    tmp = directory.parent / f".{directory.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():  # peft looks for a config.json next to the base (a GGUF has none)
        warnings.filterwarnings("ignore", message=r"Could not find a config file in ", category=UserWarning)
        pm.save_pretrained(str(tmp), safe_serialization=True, state_dict=state)
    set_new_file_mode(f for f in tmp.rglob("*") if f.is_file())
    replace_dir(tmp, directory)
    return directory


def load_adapter(wm: WideModel, directory: str | os.PathLike, merge: bool = False) -> None:
    """Attach a saved adapter to ``wm`` (inference); ``merge`` folds ``W + (alpha / r) B A`` into the base weights.
    Raises WideError when peft is missing, ``wm`` has an adapter already, or it does not fit the model."""
    peft = _import_peft()
    if peft_model(wm) is not None:
        raise WideError("this model already has a LoRA adapter")
    try:
        pm = peft.PeftModel.from_pretrained(wm.base, str(directory), is_trainable=False)
    except Exception as e:  # noqa: BLE001 - peft raises many types for a config or weights that do not fit
        raise WideError(f"cannot load LoRA adapter {str(directory)!r}: {first_line(e)}") from None
    if merge:
        pm.merge_and_unload()  # in place: plain nn.Linear layers again
    else:
        wm.__dict__[_PEFT_ATTR] = pm
    wm.install_hooks()
