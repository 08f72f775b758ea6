"""`WideConfig`, the one configuration of a WIDE model (paper §3.1-3.2), `ModelDims`, and atomic file writes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from wide.errors import WideError

SEED_MAX = 2 ** 32 - 1  #: every ``--seed`` lies in ``[0, SEED_MAX]``
CONFIG_NAME = "wide_config.json"
SPARSITY_MODES = ("global", "uniform")
#: what the target sparsity S counts: Eq. 6's skipped groups, or the skipped compute of the routed modules
SPARSITY_UNITS = ("groups", "flops")
HELDOUT_EVERY = 10  #: one calibration document in ten is held out of training to fit the routers' logit shift
FIT_TOKENS = 16384  #: held-out tokens the logit shift is fitted on after training
ROUTED_CHOICES = ("both", "attn", "ffn")
METHODS = ("wide", "skipgpt")
#: Gumbel temperatures training accepts: the logits are divided by tau, so below 1e-3 they overflow
TAU_MIN, TAU_MAX = 1e-3, 1e3
#: a field's annotation -> (the types a JSON value may have, words for the message); JSON true / false are no numbers
_TYPES = {"int | None": ((int, type(None)), "an integer or null"), "int": ((int,), "an integer"),
          "float": ((int, float), "a number"), "str": ((str,), "a string")}


@dataclass(frozen=True)
class ModelDims:
    """Shape of a Llama-family decoder that WIDE routing depends on."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def attn_width(self) -> int:  # the width entering o_proj
        return self.num_heads * self.head_dim

    @property
    def gqa_group_size(self) -> int:  # Eq. 2's default attention G: H_q / H_k * d
        return self.num_heads // self.num_kv_heads * self.head_dim

    def legal_attn_group_sizes(self) -> list[int]:
        """Every multiple of ``head_dim`` that divides the attention width."""
        return [g for g in range(self.head_dim, self.attn_width + 1, self.head_dim) if self.attn_width % g == 0]

    def attn_group_size_error(self, g, where: str = "") -> str | None:
        """The one-line message for an attention group size ``g`` that does not fit (``where`` names the model), else
        None."""
        if g in self.legal_attn_group_sizes():
            return None
        return (f"attention group size G={g} must be a positive multiple of head_dim={self.head_dim} that divides the "
                f"attention width {self.attn_width}{where}: pass --attn-group-size with one of "
                f"{self.legal_attn_group_sizes()}")

    def legal_ffn_group_sizes(self) -> list[int]:
        """Every power of two ``>= 16`` that divides the FFN width (the paper's set ``T``)."""
        return [1 << k for k in range(4, self.intermediate_size.bit_length()) if self.intermediate_size % (1 << k) == 0]

    def ffn_group_size_error(self, g, where: str = "", why: str = "") -> str | None:
        """The one-line message for an FFN group size ``g`` that does not fit (``where`` names the model), else None."""
        legal = self.legal_ffn_group_sizes()
        if g in legal:
            return None
        if not legal:
            return (f"no legal FFN group size divides intermediate_size={self.intermediate_size}{where} (legal sizes "
                    f"are powers of two >= 16 that divide it: 16, 32, 64, ...): WIDE cannot group this model's FFN "
                    f"neurons; use a model whose intermediate size is a multiple of 16")
        return (f"FFN group size G={g} must be a power of two >= 16 that divides the intermediate size "
                f"{self.intermediate_size}{where}: pass --ffn-group-size with one of {legal}{why}")


@dataclass
class WideConfig:
    """Hyper-parameters of a WIDE model, checked on construction (WideError names the field and what is allowed).

    ``attn_group_size`` ``G`` (a multiple of ``head_dim``; None: the GQA group, Eq. 2) and ``ffn_group_size`` (a
    power of two ``>= 16``, Eq. 3) must divide their widths; ``router_rank`` ``r`` (Eq. 4); ``target_sparsity`` ``S``
    in ``[0, 1)`` and ``alpha >= 0`` (Eq. 6); the Gumbel temperature anneals from ``tau_start`` to ``tau_end``;
    ``sparsity_mode`` ``"global"`` (Eq. 6) or ``"uniform"`` (Eq. 22); ``routed``: both, attn or ffn; ``method``
    ``"skipgpt"``: one gate per module (``N_G = 1``), the dynamic-depth baseline of §4.1. ``sparsity_unit``:
    ``"groups"`` (Eq. 6 / Eq. 22) or ``"flops"`` (the fraction of the routed compute skipped, at the context length
    ``seq_len`` the weights were trained at; :func:`wide.routing.module_weights`); ``max_module_sparsity`` in
    ``(0, 1]`` bounds every module's skip rate (1.0: no bound).
    """

    attn_group_size: int | None = None
    ffn_group_size: int = 128
    router_rank: int = 16
    target_sparsity: float = 0.5
    alpha: float = 20.0
    tau_start: float = 5.0
    tau_end: float = 0.5
    sparsity_mode: str = "global"
    routed: str = "both"
    method: str = "wide"
    sparsity_unit: str = "groups"
    max_module_sparsity: float = 1.0
    seq_len: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            (types, words), value = _TYPES[f.type], getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, types):
                raise WideError(f"WideConfig field {f.name}={value!r} ({type(value).__name__}) must be {words}")
        if self.attn_group_size is not None and self.attn_group_size < 1:
            raise WideError(f"attention group size G={self.attn_group_size!r} must be a positive multiple of head_dim")
        if math.isnan(self.target_sparsity) or not 0.0 <= self.target_sparsity < 1.0:
            raise WideError(f"target sparsity S={self.target_sparsity!r} is outside [0, 1)")
        if not math.isfinite(self.alpha) or self.alpha < 0:
            raise WideError(f"alpha={self.alpha!r} must be >= 0 and finite")
        if self.router_rank < 1:
            raise WideError(f"router rank r={self.router_rank!r} must be a positive integer")
        for name in ("tau_start", "tau_end"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise WideError(f"{name}={getattr(self, name)!r} must be a finite number > 0 (training accepts "
                                f"{TAU_MIN:g} to {TAU_MAX:g})")
        if math.isnan(self.max_module_sparsity) or not 0.0 < self.max_module_sparsity <= 1.0:
            raise WideError(f"max module sparsity {self.max_module_sparsity!r} is outside (0, 1] (1.0: no bound)")
        if self.seq_len is not None and self.seq_len < 1:
            raise WideError(f"seq_len={self.seq_len!r} must be a positive number of tokens (or null)")
        for name, allowed in (("sparsity_mode", SPARSITY_MODES), ("routed", ROUTED_CHOICES), ("method", METHODS),
                              ("sparsity_unit", SPARSITY_UNITS)):
            if getattr(self, name) not in allowed:
                what = {"sparsity_mode": "sparsity mode ", "sparsity_unit": "sparsity unit "}.get(name, f"{name}=")
                raise WideError(f"{what}{getattr(self, name)!r} is not one of {', '.join(allowed)}")
        g = self.ffn_group_size
        if self.method == "skipgpt" and g < 1:
            raise WideError(f"FFN group size G={g!r} must be a positive integer")
        if self.method == "wide" and (g < 16 or g & (g - 1)):
            raise WideError(f"FFN group size G={g!r} must be a power of two >= 16 (16, 32, 64, ...; "
                            f"`wide info --model M` lists the sizes that divide that model's FFN)")

    @property
    def route_attn(self) -> bool:
        return self.routed in ("both", "attn")

    @property
    def route_ffn(self) -> bool:
        return self.routed in ("both", "ffn")

    def check_training(self) -> None:
        """Raises WideError for a ``tau_start`` / ``tau_end`` outside ``[TAU_MIN, TAU_MAX]`` (training only)."""
        for name in ("tau_start", "tau_end"):
            if not TAU_MIN <= getattr(self, name) <= TAU_MAX:
                raise WideError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is outside [{TAU_MIN:g}, "
                                f"{TAU_MAX:g}] (the Gumbel-softmax temperature divides the router logits: below "
                                f"{TAU_MIN:g} they overflow)")

    def resolve(self, dims: ModelDims) -> WideConfig:
        """A copy with ``attn_group_size`` filled in, every size checked against ``dims`` (skipgpt: ``N_G = 1``).

        Raises:
            WideError: a group size that does not divide its width (listing the legal ones), or ``r > D``.
        """
        if self.router_rank > dims.hidden_size:
            raise WideError(f"router rank r={self.router_rank} must be at most the hidden size D={dims.hidden_size} "
                            f"(the router is a bottleneck D -> r -> 2 N_G; the default is 16)")
        if self.method == "skipgpt":
            return dataclasses.replace(self, attn_group_size=dims.attn_width, ffn_group_size=dims.intermediate_size)
        g_attn = dims.gqa_group_size if self.attn_group_size is None else self.attn_group_size
        if g_attn % dims.head_dim or dims.attn_width % g_attn:
            raise WideError(f"attention group size G={g_attn} must be a multiple of head_dim={dims.head_dim} that "
                            f"divides the attention width {dims.attn_width}; legal: {dims.legal_attn_group_sizes()}")
        if not dims.legal_ffn_group_sizes():
            raise WideError(dims.ffn_group_size_error(self.ffn_group_size))
        if dims.intermediate_size % self.ffn_group_size:
            raise WideError(f"FFN group size G={self.ffn_group_size} does not divide the intermediate size "
                            f"{dims.intermediate_size}; legal: {dims.legal_ffn_group_sizes()}")
        return dataclasses.replace(self, attn_group_size=g_attn)

    def n_groups(self, dims: ModelDims) -> tuple[int, int]:
        """``(N_G attention, N_G FFN)`` of a resolved config."""
        return dims.attn_width // self.attn_group_size, dims.intermediate_size // self.ffn_group_size

    def tau_at(self, step: int, total_steps: int) -> float:
        """Linear schedule: ``tau_start`` at step 0, ``tau_end`` at step ``total_steps - 1``."""
        frac = min(max(step / (total_steps - 1), 0.0), 1.0) if total_steps > 1 else 1.0
        return float(self.tau_start + (self.tau_end - self.tau_start) * frac)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> WideConfig:
        """Build from a parsed JSON object; missing keys take the defaults. Raises WideError on unknown keys."""
        if not isinstance(data, dict):
            raise WideError(f"WideConfig data must be a JSON object, not {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(map(str, set(data) - set(known)))
        if unknown:
            raise WideError(f"unknown WideConfig keys {unknown}; allowed: {known}")
        return cls(**data)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``<directory>/wide_config.json`` atomically."""
        path = Path(directory) / CONFIG_NAME
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> WideConfig:
        """Read ``<directory>/wide_config.json``. Raises WideError naming the file (and the field) when bad."""
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise WideError(f"no {CONFIG_NAME} in {str(directory)!r}: not a WIDE checkpoint directory")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (ValueError, UnicodeDecodeError) as e:  # JSON errors and WideError are ValueErrors
            raise WideError(f"corrupt {path}: {e}") from None


def new_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666 & ~umask``."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def set_new_file_mode(paths) -> None:
    """Give each file in ``paths`` :func:`new_file_mode` (safetensors creates its files ``0o600``)."""
    mode = new_file_mode()
    for path in paths:
        os.chmod(path, mode)


def atomic_write(path: str | os.PathLike, write) -> None:
    """Create or replace ``path`` atomically: ``write(tmp)`` fills a temporary file in the same folder, which gets
    :func:`new_file_mode` and is renamed over ``path`` (``os.replace``); on error ``path`` stays as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the finished folder ``tmp`` in place of ``final`` (the old one is moved aside first, then deleted)."""
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically and durably (fsync before the rename)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, write)
