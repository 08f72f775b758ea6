"""Stage-2 LoRA recovery (paper §3.2, settings of §4.1) with peft.

LoRA (``r=16``, ``lora_alpha=32``, ``lora_dropout=0.1`` by default) goes on all seven linear modules of
every decoder layer: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``. peft replaces those modules in place inside :attr:`WideModel.base`, so the routing hooks are
re-installed afterwards (:meth:`WideModel.install_hooks`): the gate hooks then sit on the LoRA-wrapped
``o_proj`` / ``down_proj`` and gate the input of both the base and the LoRA path (Eq. 2-3).

The adapter is saved in peft's own format (``adapter_config.json`` + ``adapter_model.safetensors``) in
``<WIDE dir>/adapter/``; :func:`load_adapter` reads it back with ``PeftModel.from_pretrained`` (safetensors,
nothing unpickled) and merges it on request with peft's ``merge_and_unload`` (peft's own scale).
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from wide.config import set_new_file_mode
from wide.errors import WideError
from wide.model import WideModel

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_ATTR = "_wide_peft_model"  # plain attribute (not a registered submodule) holding the PeftModel


@dataclass
class LoraSettings:
    """LoRA hyper-parameters (paper §4.1: ``r=16``, ``alpha=32``, dropout 0.1).

    Attributes:
        r: rank, a positive integer.
        alpha: ``lora_alpha`` (> 0); peft scales the update by ``alpha / r``.
        dropout: dropout on the LoRA input, in ``[0, 1)``.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.1

    def validate(self) -> None:
        """Raises WideError naming the bad value: ``r < 1``, ``alpha <= 0``, dropout outside ``[0, 1)``."""
        if not isinstance(self.r, int) or self.r < 1:
            raise WideError(f"--lora-r {self.r!r} must be a positive integer")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise WideError(f"--lora-alpha {self.alpha!r} must be > 0")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise WideError(f"--lora-dropout {self.dropout!r} must be in [0, 1)")

    def check_dims(self, dims) -> None:
        """Refuse a rank above the smallest side of the target projections (:func:`max_lora_rank`), before any
        adapter is built (``--lora-r 100000`` would otherwise allocate ``r * (in + out)`` weights per projection
        and be killed for memory before the training memory check).

        Args:
            dims: the base model's :class:`wide.config.ModelDims`.

        Raises:
            WideError: ``--lora-r <r> must be at most <max> ...``, naming the projection that bounds it.
        """
        limit, names = max_lora_rank(dims)
        if self.r > limit:
            raise WideError(f"--lora-r {self.r} must be at most {limit}, the smaller side (min(in, out)) of the "
                            f"LoRA target {' / '.join(names)} of this model; a higher rank adds parameters but "
                            f"no capacity (the paper uses 16)")

    def to_dict(self) -> dict:
        """``{"r", "alpha", "dropout"}`` (JSON-able; stored in the training state and ``base_model.json``)."""
        return asdict(self)

    def peft_config(self):
        """The ``peft.LoraConfig`` on all seven projections (no bias, no task head)."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(LORA_TARGETS), bias="none")


def lora_target_shapes(dims) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each of the seven LoRA target projections of a decoder layer of a
    model with :class:`wide.config.ModelDims` ``dims``."""
    d, i = dims.hidden_size, dims.intermediate_size
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, i),
            "up_proj": (d, i), "down_proj": (i, d)}


def max_lora_rank(dims) -> tuple[int, list[str]]:
    """The largest useful LoRA rank: ``min(in, out)`` over the target projections, and the projections
    that set it."""
    sides = {n: min(shape) for n, shape in lora_target_shapes(dims).items()}
    limit = min(sides.values())
    return limit, [n for n, v in sides.items() if v == limit]


class KeyedDropout(torch.nn.Module):
    """Dropout on the LoRA input whose mask depends only on (seed, sample position, module), not on the world
    size, the rank or recomputation (so stage-2 losses match across world sizes and under activation
    checkpointing). Inside :func:`wide.train.loop.train` the keep mask of row ``b`` is drawn from a generator
    seeded with ``(seed, positions[b], "lora_dropout", name)``; elsewhere in training mode it is plain
    ``torch.nn.functional.dropout``; in eval mode the identity.

    Args:
        p: drop probability in ``[0, 1)``.
        name: the module's stable name (its LoRA layer's name in the base model).
    """

    def __init__(self, p: float, name: str) -> None:
        super().__init__()
        self.p = float(p)
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, in]`` (any float dtype) -> same shape and dtype."""
        if not self.training or self.p == 0.0:
            return x
        from wide.train.loop import current_samples, sample_keyed_uniform

        if current_samples() is None:
            return torch.nn.functional.dropout(x, self.p, True)
        u = sample_keyed_uniform(x.shape, x.device, torch.float32, ("lora_dropout", self.name))
        keep = (u >= self.p).to(x.dtype)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, name={self.name!r}"


def use_keyed_dropout(wm: WideModel) -> int:
    """Replace peft's ``nn.Dropout`` on every LoRA input by :class:`KeyedDropout` (same ``p``); returns how many."""
    n = 0
    for name, mod in wm.base.named_modules():
        drops = getattr(mod, "lora_dropout", None)
        if isinstance(drops, torch.nn.ModuleDict):
            for adapter, d in list(drops.items()):
                if isinstance(d, torch.nn.Dropout):
                    drops[adapter] = KeyedDropout(d.p, name)
                    n += 1
    return n


def _import_peft():
    try:
        import peft  # noqa: F401
    except ImportError:
        raise WideError("LoRA recovery needs peft: pip install 'wide[quality]' (peft==0.21.2)") from None


def peft_model(wm: WideModel):
    """The ``peft.PeftModel`` wrapping ``wm.base`` after :func:`attach_lora` / :func:`load_adapter`, or None."""
    return wm.__dict__.get(_PEFT_ATTR)


def attach_lora(wm: WideModel, settings: LoraSettings | None = None):
    """Inject fresh LoRA adapters into every decoder layer's seven projections and re-install the hooks.

    Base weights stay frozen; the LoRA parameters (``lora_A`` random, ``lora_B`` zero, so the model's output
    is unchanged at first) require gradients. Router ``requires_grad`` is left as it is.

    Args:
        wm: a routed model without an adapter.
        settings: LoRA hyper-parameters (default: paper §4.1).

    Returns:
        the ``peft.PeftModel`` (also kept on ``wm``, see :func:`peft_model`).

    Raises:
        WideError: peft missing, bad settings (a rank above the projections' sides included, see
            :meth:`LoraSettings.check_dims`), or ``wm`` already has an adapter.
    """
    _import_peft()
    from peft import get_peft_model

    settings = settings or LoraSettings()
    settings.validate()
    settings.check_dims(wm.dims)
    if peft_model(wm) is not None or any("lora_" in n for n, _ in wm.base.named_parameters()):
        raise WideError("this model already has a LoRA adapter")
    router_flags = [p.requires_grad for p in wm.router_parameters()]
    pm = get_peft_model(wm.base, settings.peft_config())  # replaces the projections of wm.base in place
    for p, f in zip(wm.router_parameters(), router_flags):
        p.requires_grad_(f)
    wm.__dict__[_PEFT_ATTR] = pm
    wm.install_hooks()
    return pm


def lora_named_parameters(wm: WideModel) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name in wm.base, parameter)`` of every LoRA weight (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``)."""
    return [(n, p) for n, p in wm.base.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def _swap_dir(tmp: Path, final: Path) -> None:
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_adapter(wm: WideModel, directory: str | os.PathLike, env=None) -> Path:
    """Save the LoRA adapter of ``wm`` with peft's ``save_pretrained`` (safetensors), atomically.

    Under FSDP every rank must call this: the LoRA shards are gathered on every rank (collective) and rank 0
    writes. The folder is written as ``.<name>.tmp`` and renamed into place; its files get the mode of a newly
    created file (``0o666 & ~umask``, :func:`wide.config.set_new_file_mode`), not safetensors' ``0o600``.

    Args:
        wm: a model with an adapter (:func:`attach_lora`).
        directory: the adapter folder, normally ``<WIDE dir>/adapter``.
        env: :class:`wide.train.fsdp.DistEnv` (default: the current one).

    Raises:
        WideError: ``wm`` has no adapter.
    """
    import wide.train.fsdp as D

    pm = peft_model(wm)
    if pm is None:
        raise WideError("this model has no LoRA adapter to save")
    env = env or D.current()
    directory = Path(directory)
    full = {f"base_model.model.{n}": D.full(p.detach()).to("cpu").contiguous() for n, p in lora_named_parameters(wm)}
    if env.is_main:
        tmp = directory.parent / f".{directory.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with warnings.catch_warnings():  # peft looks for a config.json next to the base (a GGUF has none)
            warnings.filterwarnings("ignore", message=r"Could not find a config file in ", category=UserWarning)
            pm.save_pretrained(str(tmp), safe_serialization=True, state_dict=full)
        set_new_file_mode(f for f in tmp.rglob("*") if f.is_file())  # safetensors writes 0600
        _swap_dir(tmp, directory)
    D.barrier(env)
    return directory


def load_adapter(wm: WideModel, directory: str | os.PathLike, merge: bool = False) -> None:
    """Attach a saved peft LoRA adapter to ``wm`` (inference), optionally merged into the base weights.

    Args:
        wm: routed model on its device, without an adapter.
        directory: folder with ``adapter_config.json`` and ``adapter_model.safetensors``.
        merge: fold ``W + (alpha / r) B A`` into the base weights with peft's ``merge_and_unload`` (the
            scale is peft's, read from the adapter config) and drop the LoRA layers.

    Raises:
        WideError: peft missing, files missing or corrupt, or an adapter that does not fit the model.
    """
    _import_peft()
    from peft import PeftModel
    from safetensors import safe_open

    directory = Path(directory)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise WideError(f"LoRA adapter {str(directory)!r} has no {name}")
    try:
        with safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001 - unreadable weights are a corrupt adapter
        raise WideError(f"corrupt LoRA adapter weights {directory / ADAPTER_WEIGHTS}: {e}") from None
    if peft_model(wm) is not None:
        raise WideError("this model already has a LoRA adapter")
    try:
        pm = PeftModel.from_pretrained(wm.base, str(directory), is_trainable=False)
    except Exception as e:  # noqa: BLE001 - peft raises many types for a config or weights that do not fit
        raise WideError(f"cannot load LoRA adapter {str(directory)!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if merge:
        pm.merge_and_unload()  # modifies wm.base in place: merged nn.Linear layers again
    else:
        wm.__dict__[_PEFT_ATTR] = pm
    wm.install_hooks()


def check_stage1(path: str | os.PathLike) -> dict:
    """Validate a stage-1 WIDE directory before any model is loaded; return its ``base_model.json``.

    Raises:
        WideError: missing directory (or a file given for it), missing or corrupt config / base info / router
            weights, or a directory that already holds a LoRA adapter.
    """
    from wide.checkpoint import ROUTERS_NAME, check_directory, read_base_info, read_safetensors
    from wide.config import WideConfig

    path = Path(path)
    check_directory(path, "stage-1 checkpoint", "the -o of `wide calibrate`")
    WideConfig.load(path)
    info = read_base_info(path)
    read_safetensors(path / ROUTERS_NAME)
    if (path / ADAPTER_DIR).exists():
        raise WideError(f"{str(path)!r} already holds a LoRA adapter; give the stage-1 (router-only) checkpoint")
    return info


def recover(wm: WideModel, blocks: torch.Tensor, args, output: str | os.PathLike, model_ref: str, *,
            settings: LoraSettings | None = None, freeze_router: bool = False, stage1: str | None = None,
            resume: bool = False, progress: bool = True, on_step=None, data_source: str | None = None,
            options: dict | None = None) -> list[dict]:
    """Stage-2 LoRA recovery (paper §3.2): LoRA on all seven projections, routers trained unless frozen.

    Same loss (LM + Eq. 6 / Eq. 22 sparsity), schedule, checkpointing, resume and logging as stage 1
    through :func:`wide.train.loop.train`. Every save writes the WIDE directory (routers, config, base
    reference) and the adapter in peft format to ``<output>/adapter``.

    Args:
        wm: routed model loaded from a stage-1 checkpoint (no adapter yet: one is attached here, its
            ``lora_A`` drawn after ``torch.manual_seed(args.seed)``).
        blocks: int64 ``[N, seq_len]`` packed token blocks.
        args: :class:`wide.train.loop.CalibrationArgs` (the CLI's default ``lr`` for this stage is 2e-4).
        output: output WIDE directory.
        model_ref: the base model's reference (from the stage-1 checkpoint).
        settings: LoRA hyper-parameters (default ``r=16, alpha=32, dropout=0.1``).
        freeze_router: keep the stage-1 routers fixed; train only LoRA.
        stage1: the stage-1 directory, recorded in ``base_model.json``.
        resume, progress, on_step, data_source, options: as in :func:`wide.train.loop.train`.

    Returns:
        the per-step records of :func:`wide.train.loop.train`.

    Raises:
        WideError: as :func:`attach_lora` and :func:`wide.train.loop.train`.
    """
    from wide.train.loop import train

    settings = settings or LoraSettings()
    settings.validate()
    if peft_model(wm) is None:
        torch.manual_seed(args.seed)  # LoRA A init: identical on every rank and for every world size
        attach_lora(wm, settings)
    use_keyed_dropout(wm)
    for n, p in wm.base.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    for p in wm.router_parameters():
        p.requires_grad_(not freeze_router)
    key = {"lora": settings.to_dict(), "freeze_router": bool(freeze_router)}
    info = {"adapter": ADAPTER_DIR, "lora": settings.to_dict(), "freeze_router": bool(freeze_router)}
    if stage1 is not None:
        info["stage1"] = str(stage1)
    return train(wm, blocks, args, output, model_ref, stage="lora", resume=resume, progress=progress,
                 on_step=on_step, extra_key=key, extra_info=info,
                 save_extra=lambda out, env: save_adapter(wm, Path(out) / ADAPTER_DIR, env), data_source=data_source,
                 options=options)
