"""`WideConfig`: the single configuration of a WIDE model (paper §3.1-3.2), saved as JSON.

One dataclass holds every method hyper-parameter: group sizes ``G`` for attention and FFN, router
rank ``r``, target sparsity ``S``, sparsity-loss weight ``alpha``, the Gumbel temperature schedule
``tau``, the sparsity mode (``global`` = Eq. 6, ``uniform`` = Eq. 22) and which modules are routed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from wide.errors import WideError

#: Every ``--seed`` (calibration, LoRA, sampling) lies in ``[0, SEED_MAX]`` (the data order seeds a 64-bit generator
#: with ``seed * 1_000_003 + epoch``).
SEED_MAX = 2 ** 32 - 1

CONFIG_NAME = "wide_config.json"
SPARSITY_MODES = ("global", "uniform")
#: the Gumbel-softmax temperature a training run accepts (:meth:`WideConfig.check_training`): the router
#: logits are divided by tau, so below 1e-3 they overflow (NaN masks), above 1e3 the masks are coin flips
TAU_MIN, TAU_MAX = 1e-3, 1e3
ROUTED_CHOICES = ("both", "attn", "ffn")
METHODS = ("wide", "skipgpt")

#: field -> (expected kind, words for the message): "int" (an integer, not bool), "int?" (an integer or
#: null), "num" (a real number, not bool), "str"
_FIELD_TYPES = {
    "attn_group_size": ("int?", "an integer or null"),
    "ffn_group_size": ("int", "an integer"),
    "router_rank": ("int", "an integer"),
    "target_sparsity": ("num", "a number"),
    "alpha": ("num", "a number"),
    "tau_start": ("num", "a number"),
    "tau_end": ("num", "a number"),
    "sparsity_mode": ("str", "a string"),
    "routed": ("str", "a string"),
    "method": ("str", "a string"),
}


def _has_type(value, kind: str) -> bool:
    if isinstance(value, bool):  # JSON true/false are not numbers here
        return False
    if kind == "int?":
        return value is None or isinstance(value, numbers.Integral)
    if kind == "int":
        return isinstance(value, numbers.Integral)
    if kind == "num":
        return isinstance(value, numbers.Real)
    return isinstance(value, str)


@dataclass(frozen=True)
class ModelDims:
    """Shape facts of a Llama-family decoder that WIDE routing depends on (all counts, no units)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def attn_width(self) -> int:
        """Width of the attention output entering ``o_proj``: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def gqa_group_size(self) -> int:
        """Paper Eq. 2 default attention ``G``: ``H_q / H_k * d``."""
        return self.num_heads // self.num_kv_heads * self.head_dim

    def legal_attn_group_sizes(self) -> list[int]:
        """Every multiple of ``head_dim`` that divides the attention width."""
        return [g for g in range(self.head_dim, self.attn_width + 1, self.head_dim) if self.attn_width % g == 0]

    def legal_ffn_group_sizes(self) -> list[int]:
        """Every power of two ``>= 16`` that divides the FFN intermediate size (paper's set ``T``)."""
        out, g = [], 16
        while g <= self.intermediate_size:
            if self.intermediate_size % g == 0:
                out.append(g)
            g *= 2
        return out

    def ffn_group_size_error(self, g, where: str = "", why: str = "") -> str | None:
        """The one-line message for an FFN group size ``g`` that does not fit these dims, else None.

        Shared by ``wide info`` and the commands that take ``--ffn-group-size`` (and :meth:`WideConfig.resolve`),
        so each lists the same legal sizes.  ``where`` names the model (e.g. `` of <path>``); ``why`` is
        appended to the advice.
        """
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
    """Hyper-parameters of a WIDE model.

    Attributes:
        attn_group_size: attention ``G`` in channels; a multiple of ``head_dim`` dividing
            ``num_heads * head_dim``. ``None`` means the GQA group ``H_q/H_k * head_dim`` (Eq. 2).
        ffn_group_size: FFN ``G`` in channels; a power of two ``>= 16`` dividing the intermediate size (Eq. 3).
        router_rank: bottleneck rank ``r`` of each router (Eq. 4).
        target_sparsity: ``S`` in ``[0, 1)``, the fraction of groups to skip (Eq. 6).
        alpha: weight of the sparsity loss, ``>= 0`` (Eq. 6).
        tau_start, tau_end: Gumbel-softmax temperature, annealed linearly over the calibration steps.
        sparsity_mode: ``"global"`` (Eq. 6) or ``"uniform"`` (Eq. 22).
        routed: ``"both"``, ``"attn"`` or ``"ffn"``: which sublayers get routers.
        method: ``"wide"`` (token-level width routing over groups, §3.1) or ``"skipgpt"`` (the dynamic-depth
            baseline of §4.1, Zhao et al. 2025: one router per attention / FFN module whose single decision
            executes or skips the whole module). For ``"skipgpt"`` :meth:`resolve` sets both group sizes to
            the full module width (``N_G = 1``), whatever they were; same loss (Eq. 6 / Eq. 22), same
            routers (Eq. 4-5). Configs saved before this field existed load as ``"wide"``.

    Raises:
        WideError: on construction, a value outside the ranges above (:meth:`validate`).
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

    def __post_init__(self) -> None:
        self.validate()

    @property
    def route_attn(self) -> bool:
        """True when the attention sublayers get routers (``routed`` is ``"both"`` or ``"attn"``)."""
        return self.routed in ("both", "attn")

    @property
    def route_ffn(self) -> bool:
        """True when the FFN sublayers get routers (``routed`` is ``"both"`` or ``"ffn"``)."""
        return self.routed in ("both", "ffn")

    def validate(self) -> None:
        """Check model-independent values.

        Raises:
            WideError: a field of the wrong type (the message names the field, the value and the expected
                type; e.g. a string or a float for ``ffn_group_size``), ``target_sparsity`` outside
                ``[0, 1)``, a negative or non-finite ``alpha``, ``router_rank < 1``, a non-positive
                ``attn_group_size``, a non-positive or non-finite tau (the training range is
                :meth:`check_training`'s), an unknown ``sparsity_mode`` / ``routed`` / ``method``, or (for
                ``method="wide"``) an ``ffn_group_size`` that is not a power of two ``>= 16``.
        """
        for name, (kind, words) in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not _has_type(value, kind):
                raise WideError(f"WideConfig field {name}={value!r} ({type(value).__name__}) must be {words}")
        if self.attn_group_size is not None and self.attn_group_size < 1:
            raise WideError(f"attention group size G={self.attn_group_size!r} must be a positive multiple of head_dim")
        s = self.target_sparsity
        if not isinstance(s, (int, float)) or math.isnan(s) or not 0.0 <= s < 1.0:
            raise WideError(f"target sparsity S={s!r} is outside [0, 1)")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha < 0:
            raise WideError(f"alpha={self.alpha!r} must be >= 0 and finite")
        if not isinstance(self.router_rank, int) or self.router_rank < 1:
            raise WideError(f"router rank r={self.router_rank!r} must be a positive integer")
        for name in ("tau_start", "tau_end"):
            tau = getattr(self, name)
            if not (math.isfinite(tau) and tau > 0):  # also rejects NaN
                raise WideError(f"{name}={tau!r} must be a finite number > 0 (training accepts "
                                f"{TAU_MIN:g} to {TAU_MAX:g})")
        if self.sparsity_mode not in SPARSITY_MODES:
            raise WideError(f"sparsity mode {self.sparsity_mode!r} is not one of {', '.join(SPARSITY_MODES)}")
        if self.routed not in ROUTED_CHOICES:
            raise WideError(f"routed={self.routed!r} is not one of {', '.join(ROUTED_CHOICES)}")
        if self.method not in METHODS:
            raise WideError(f"method={self.method!r} is not one of {', '.join(METHODS)}")
        if self.method == "skipgpt":  # whole-module gates: resolve() sets G to the module width
            if not isinstance(self.ffn_group_size, int) or self.ffn_group_size < 1:
                raise WideError(f"FFN group size G={self.ffn_group_size!r} must be a positive integer")
            return
        if self.ffn_group_size < 16 or self.ffn_group_size & (self.ffn_group_size - 1):
            raise WideError(f"FFN group size G={self.ffn_group_size!r} must be a power of two >= 16 (16, 32, 64, ...; "
                            f"`wide info --model M` lists the sizes that divide that model's FFN)")

    def check_training(self) -> None:
        """Check what only training uses (a saved config outside it still loads for inference): the Gumbel
        temperatures ``tau_start`` and ``tau_end`` must lie in ``[TAU_MIN, TAU_MAX]`` = ``[1e-3, 1e3]``.

        Raises:
            WideError: ``--tau-start`` / ``--tau-end`` outside that range, naming the value and the range.
        """
        for name in ("tau_start", "tau_end"):
            tau = getattr(self, name)
            if not TAU_MIN <= tau <= TAU_MAX:
                raise WideError(f"--{name.replace('_', '-')} {tau!r} is outside [{TAU_MIN:g}, {TAU_MAX:g}] (the "
                                f"Gumbel-softmax temperature divides the router logits: below {TAU_MIN:g} they "
                                f"overflow)")

    def resolve(self, dims: ModelDims) -> WideConfig:
        """Return a copy with ``attn_group_size`` filled in and every size checked against ``dims``.

        For ``method="skipgpt"`` both group sizes become the full module widths (``N_G = 1`` per module).

        Raises:
            WideError: a group size that does not divide its dimension or is not a multiple of
                ``head_dim``; the message lists the legal sizes.  A router rank larger than the hidden size
                ``D`` (Eq. 4's bottleneck must be narrower than its input).  A model whose intermediate size no
                legal FFN group size divides (:meth:`ModelDims.ffn_group_size_error`).
        """
        if int(self.router_rank) > dims.hidden_size:
            raise WideError(f"router rank r={self.router_rank} must be at most the hidden size D={dims.hidden_size} "
                            f"(the router is a bottleneck D -> r -> 2 N_G; the default is 16)")
        if self.method == "skipgpt":
            return dataclasses.replace(self, attn_group_size=dims.attn_width, ffn_group_size=dims.intermediate_size)
        g_attn = dims.gqa_group_size if self.attn_group_size is None else int(self.attn_group_size)
        if g_attn <= 0 or g_attn % dims.head_dim or dims.attn_width % g_attn:
            raise WideError(
                f"attention group size G={g_attn} must be a multiple of head_dim={dims.head_dim} that divides "
                f"the attention width {dims.attn_width}; legal: {dims.legal_attn_group_sizes()}"
            )
        g_ffn = int(self.ffn_group_size)
        if not dims.legal_ffn_group_sizes():
            raise WideError(dims.ffn_group_size_error(g_ffn))
        if g_ffn <= 0 or dims.intermediate_size % g_ffn:
            raise WideError(
                f"FFN group size G={g_ffn} does not divide the intermediate size {dims.intermediate_size}; "
                f"legal: {dims.legal_ffn_group_sizes()}"
            )
        return dataclasses.replace(self, attn_group_size=g_attn, ffn_group_size=g_ffn)

    def n_groups(self, dims: ModelDims) -> tuple[int, int]:
        """``(N_G attention, N_G FFN)`` for a resolved config."""
        return dims.attn_width // self.attn_group_size, dims.intermediate_size // self.ffn_group_size

    def tau_at(self, step: int, total_steps: int) -> float:
        """Linear temperature schedule: ``tau_start`` at step 0, ``tau_end`` at step ``total_steps - 1``."""
        if total_steps <= 1:
            return float(self.tau_end)
        frac = min(max(step / (total_steps - 1), 0.0), 1.0)
        return float(self.tau_start + (self.tau_end - self.tau_start) * frac)

    # --- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (what :meth:`save` writes)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> WideConfig:
        """Build from a dict (e.g. a parsed ``wide_config.json``); missing keys take the defaults.

        Raises:
            WideError: ``data`` is not a dict, has keys that are not fields (the message lists the allowed
                ones), or a field of the wrong type or value (see :meth:`validate`).
        """
        if not isinstance(data, dict):
            raise WideError(f"WideConfig data must be a JSON object, not {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(map(str, set(data) - set(known)))
        if unknown:
            raise WideError(f"unknown WideConfig keys {unknown}; allowed: {known}")
        return cls(**data)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``<directory>/wide_config.json`` atomically; returns its path."""
        path = Path(directory) / CONFIG_NAME
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> WideConfig:
        """Read ``<directory>/wide_config.json``.

        Raises:
            WideError: the file is missing, is not JSON, or holds a bad config; the message names the file
                and, for a bad config, the field, its value and what is allowed.
        """
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise WideError(f"no {CONFIG_NAME} in {str(directory)!r}: not a WIDE checkpoint directory")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WideError(f"corrupt {path}: {e}") from None
        if not isinstance(data, dict):
            raise WideError(f"corrupt {path}: expected a JSON object")
        try:
            return cls.from_dict(data)
        except WideError as e:
            raise WideError(f"corrupt {path}: {e}") from None


def new_file_mode() -> int:
    """The permission bits ``open(path, "w")`` gives a new file: ``0o666 & ~umask`` (e.g. ``0o644``).

    The atomic writers give their temporary file (``tempfile.mkstemp`` makes it ``0o600``) this mode
    before the rename, so checkpoint files get the same mode as files written directly.
    """
    umask = os.umask(0o022)  # read the umask: set it and put it back at once
    os.umask(umask)
    return 0o666 & ~umask


def set_new_file_mode(paths) -> None:
    """Give each file in ``paths`` the mode of a newly created file (:func:`new_file_mode`, e.g. ``0o644``).

    For files another library wrote with ``0o600``: safetensors' ``save_file`` creates its files so, and with it
    peft's and transformers' ``save_pretrained`` (the LoRA adapter, a pruned model's weights).

    Args:
        paths: paths of regular files (any iterable).
    """
    mode = new_file_mode()
    for path in paths:
        os.chmod(path, mode)


def atomic_write(path: str | os.PathLike, write) -> None:
    """Create or replace ``path`` atomically: ``write(tmp)`` fills a temporary file in the same folder, which
    then gets the mode of a newly created file (:func:`new_file_mode`, not ``mkstemp``'s ``0o600``) and is
    renamed over ``path`` with ``os.replace``. On any error the temporary file is removed and ``path`` is
    left as it was. The one writer behind every checkpoint, state and result file.

    Args:
        path: the file to write (its folder is created).
        write: a callable taking the temporary file's path (str) and writing the whole content to it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, new_file_mode())  # after write, which may recreate the file (safetensors does)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cache_dir() -> str:
    """Directory of wide's caches (the kernel autotuning cache, parsed GGUF configs): ``$WIDE_CACHE_DIR`` or
    ``~/.cache/wide``. Not created here."""
    return os.environ.get("WIDE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "wide")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically and durably (fsync before the rename; :func:`atomic_write`)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, write)
