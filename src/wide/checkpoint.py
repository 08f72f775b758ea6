"""WIDE checkpoint directories: routers as safetensors, ``wide_config.json`` and the base-model reference.

Layout of a saved directory::

    routers.safetensors   # float32 router weights, keys "attn.<layer>.w1.weight", ...
    wide_config.json      # the WideConfig
    base_model.json       # {"model": <ref>, "fingerprint": <hash>, "architecture": ..., "dims": {...}}

Every file is written atomically (temporary file, then rename); nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import torch

from wide.config import CONFIG_NAME, ModelDims, WideConfig, atomic_write, atomic_write_text
from wide.errors import WideError, WideWarning
from wide.model import (
    DEFAULT_MODEL,
    WideModel,
    check_architecture,
    check_device,
    check_router_weights,
    default_device,
    dims_of,
    fingerprint,
    fingerprint_like,
    load_base_model,
    router_shapes,
)

ROUTERS_NAME = "routers.safetensors"
BASE_NAME = "base_model.json"


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write a safetensors file atomically (temporary file in the same folder, then ``os.replace``).

    Args:
        tensors: name -> tensor (any dtype safetensors supports; contiguous, not sharing memory).
        path: the file to write.
        metadata: optional ``str -> str`` header metadata.

    The file gets the mode of a newly created file (:func:`wide.config.new_file_mode`), not ``0o600``.
    """
    from safetensors.torch import save_file

    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a safetensors file. Raises WideError if it is missing or corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        raise WideError(f"checkpoint file {path} is a directory; it must be the safetensors file")
    if not path.is_file():
        raise WideError(f"missing checkpoint file {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise WideError(f"corrupt checkpoint file {path}: {e}") from None


def save_wide(model: WideModel, directory: str | os.PathLike, model_ref: str, extra: dict | None = None,
              routers: dict[str, torch.Tensor] | None = None, base_fingerprint: str | None = None) -> Path:
    """Save routers, config and base-model reference into ``directory`` (created if needed).

    Args:
        model: the routed model.
        directory: output folder.
        model_ref: how to load the base model again (``--model`` value).
        extra: optional JSON-able facts stored in ``base_model.json`` under ``"extra"``.
        routers: router weights to write instead of ``model.router_state_dict()`` (float32 CPU tensors;
            used when the model is sharded with FSDP and the caller gathered them).
        base_fingerprint: the base model's :func:`~wide.model.fingerprint`, if already computed
            (a sharded model cannot compute it).
    """
    directory = Path(directory)
    routers = model.router_state_dict() if routers is None else routers
    atomic_save_safetensors(routers, directory / ROUTERS_NAME, metadata={"format": "wide-routers-v1"})
    base = {
        "model": model_ref,
        "fingerprint": base_fingerprint or fingerprint(model.base),
        "architecture": check_architecture(model.base.config),
        "dims": model.dims.__dict__,
    }
    if extra:
        base["extra"] = extra
    atomic_write_text(directory / BASE_NAME, json.dumps(base, indent=2) + "\n")
    model.config.save(directory)
    return directory


#: base_model.json's top-level fields -> (required, what is allowed); checked by :func:`read_base_info`
_BASE_FIELDS = {
    "model": (True, "a non-empty string (the --model the checkpoint was made with)"),
    "fingerprint": (True, "a non-empty string (the base model's weight hash)"),
    "architecture": (False, "a string (the base model's architecture class)"),
    "dims": (False, "an object of the six model dims (num_layers, hidden_size, num_heads, num_kv_heads, "
                    "head_dim, intermediate_size), each a positive integer"),
    "extra": (False, "an object (facts about the run that wrote the checkpoint)"),
}
#: the "extra" facts a training run writes (step / steps / stage, and a stage-2 run's adapter / lora /
#: freeze_router / stage1) -> (expected kind, what is allowed); other keys of "extra" are free
_EXTRA_FIELDS = {
    "step": ("count", "an integer >= 0"),
    "steps": ("count", "an integer >= 0"),
    "stage": ("str", "a string"),
    "adapter": ("str", "a string"),
    "stage1": ("str", "a string"),
    "freeze_router": ("bool", "true or false"),
    "lora": ("dict", "an object"),
}


def _json_kind(value) -> str:
    """How JSON spells ``value``'s type, for messages: ``null``, ``true``, a number, a string, ...."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"[:80]
    return "a list" if isinstance(value, list) else "an object"


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_base_info(info, path: Path) -> None:
    """Check the schema of a parsed ``base_model.json`` (every field's type; see :data:`_BASE_FIELDS`).

    Raises:
        WideError: ``corrupt <path>: field '<name>' is <value>; it must be <what is allowed>``, or a missing
            required field, or a field that ``base_model.json`` does not have (the message lists the allowed).
    """
    if not isinstance(info, dict):
        raise WideError(f"corrupt {path}: it holds {_json_kind(info)}; it must be a JSON object with the fields "
                        f"{list(_BASE_FIELDS)}")
    unknown = sorted(map(str, set(info) - set(_BASE_FIELDS)))
    if unknown:
        raise WideError(f"corrupt {path}: unknown field(s) {unknown}; allowed: {list(_BASE_FIELDS)}")
    for name, (required, allowed) in _BASE_FIELDS.items():
        if name not in info:
            if required:
                raise WideError(f"corrupt {path}: field {name!r} is missing; it must be {allowed}")
            continue
        v = info[name]
        if name in ("model", "fingerprint"):
            ok = isinstance(v, str) and bool(v.strip())
        elif name == "architecture":
            ok = isinstance(v, str)
        elif name == "dims":
            ok = (isinstance(v, dict) and set(v) == {f.name for f in dataclasses.fields(ModelDims)}
                  and all(_is_count(x) and x > 0 for x in v.values()))
        else:
            ok = isinstance(v, dict)
        if not ok:
            raise WideError(f"corrupt {path}: field {name!r} is {_json_kind(v)}; it must be {allowed}")
    for key, (kind, allowed) in _EXTRA_FIELDS.items():
        if key not in info.get("extra", {}):
            continue
        v = info["extra"][key]
        ok = {"count": _is_count, "str": lambda x: isinstance(x, str), "bool": lambda x: isinstance(x, bool),
              "dict": lambda x: isinstance(x, dict)}[kind](v)
        if not ok:
            raise WideError(f"corrupt {path}: field 'extra.{key}' is {_json_kind(v)}; it must be {allowed}")


def read_base_info(directory: str | os.PathLike) -> dict:
    """``<directory>/base_model.json``, its schema checked (before any weight loads).

    Returns:
        the parsed object: ``{"model": str, "fingerprint": str}`` and optionally ``"architecture"`` (str),
        ``"dims"`` (the six :class:`~wide.config.ModelDims` fields, positive ints) and ``"extra"`` (an object
        whose training facts ``step`` / ``steps`` are ints >= 0, ``stage`` a string, ...).

    Raises:
        WideError: the file is missing, is not JSON, or a field is missing, unknown or of the wrong type; the
            message names the file, the field, its value and what is allowed.
    """
    path = Path(directory) / BASE_NAME
    if not path.is_file():
        raise WideError(f"no {BASE_NAME} in {str(directory)!r}: not a WIDE checkpoint directory")
    try:
        info = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WideError(f"corrupt {path}: {e}") from None
    _check_base_info(info, path)
    return info


def read_config(directory: str | os.PathLike, base: torch.nn.Module) -> WideConfig:
    """``<directory>/wide_config.json`` checked against the Hugging Face model ``base`` (its group sizes must fit).

    Raises:
        WideError: the file is missing or holds a bad value; the message names the file, the value and what
            is allowed (e.g. the legal group sizes of ``base``).
    """
    config = WideConfig.load(directory)
    _check_fits(config, dims_of(base.config), directory)
    return config


def check_directory(path: Path, what: str, expected: str) -> None:
    """A checkpoint path given where a directory is expected must be one.

    Args:
        path: the path given (e.g. ``--wide``).
        what: how the message names it, e.g. ``"WIDE checkpoint"``.
        expected: what it should be, e.g. ``"the -o of `wide calibrate` or `wide lora`"``.

    Raises:
        WideError: ``path`` is a file (the message says so, that a checkpoint directory is expected and, for one of
            a checkpoint's own files, names its folder), or does not exist.
    """
    if path.is_file():
        inside = (f"; {path.name} is one of its files: give its folder {str(path.parent)!r}"
                  if path.name in (CONFIG_NAME, BASE_NAME, ROUTERS_NAME) else "")
        raise WideError(f"{what} {str(path)!r} is a file, but a checkpoint directory is expected ({expected}, "
                        f"holding {CONFIG_NAME}, {BASE_NAME} and {ROUTERS_NAME}){inside}")
    if not path.is_dir():
        raise WideError(f"{what} {str(path)!r} not found (expected {expected}, a directory with {CONFIG_NAME})")


def _check_routers(routers: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], path: Path,
                   source: str | None = None) -> None:
    """:func:`wide.model.check_router_weights`, its WideError prefixed with the router file (and followed by
    where the needed shapes come from, ``source``, when that is not the loaded model)."""
    try:
        check_router_weights(routers, shapes)
    except WideError as e:
        raise WideError(f"{path / ROUTERS_NAME}: {e}" + (f" (the shapes it needs come from {source})" if source
                                                          else "")) from None


def _saved_dims(info: dict) -> ModelDims | None:
    """The ``dims`` recorded in a checked ``base_model.json`` (:func:`read_base_info`) as ModelDims, or None."""
    d = info.get("dims")
    return None if d is None else ModelDims(**d)


def _check_fits(config: WideConfig, dims, directory: str | os.PathLike) -> None:
    """``config.resolve(dims)``; its WideError (a group size that does not fit) is prefixed with the file."""
    try:
        config.resolve(dims)
    except WideError as e:
        raise WideError(f"corrupt {Path(directory) / CONFIG_NAME}: {e}") from None


def load(path: str | os.PathLike, model: str | torch.nn.Module | None = None, device=None, dtype=None,
         tokenizer: bool = False, merge_lora: bool = False, check=None, config_check=None):
    """Load a saved WIDE model, ready for evaluation (argmax routing).

    Args:
        path: a directory written by :func:`save_wide` (``wide calibrate`` / ``wide lora`` output).
        model: ``None`` to load the base model recorded in the checkpoint, a ``--model`` string, or an
            already loaded Hugging Face model.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``; default CUDA when available.
        dtype: the base model's parameter dtype (``torch.bfloat16`` / ``float16`` / ``float32``); default
            bf16 on a GPU, fp32 on the CPU. The routers stay fp32 whatever the dtype. With ``float16`` the base
            model is loaded in fp32 on the CPU, checked against the checkpoint's fingerprint, then cast and moved
            (fp16 rounds the weights differently from the bf16 values the fingerprint hashes), so the CPU needs
            4 bytes a parameter for the time of the load.
        tokenizer: also return the tokenizer (then ``model`` must not be a module).
        merge_lora: if the directory holds a stage-2 LoRA adapter (``adapter/``, peft format), fold it into
            the base weights with peft's own merge and scale (``lora_alpha / r``); otherwise (default) keep
            it as separate peft LoRA layers. Either way the routing hooks gate the adapted projections.
        check: optional callable ``f(hf_config, tokenizer)`` run after the checkpoint's own files are checked
            and before any base weight is read (:func:`wide.model.load_base_model`'s hook), e.g. to validate
            sizes against the model's context; not called when ``model`` is an already loaded module.
        config_check: optional callable ``f(hf_config)``, likewise, run before the base model's tokenizer loads.

    Returns:
        :class:`WideModel` (or ``(WideModel, tokenizer)``) in eval mode. Calling it as a Hugging Face
        causal LM, ``model(input_ids)`` with int64 ``input_ids [B, T]`` (optional ``attention_mask [B, T]``),
        returns logits ``[B, T, vocab]`` in the model dtype; each token's routing decisions are bool
        ``[B, T, N_G]`` masks per layer (True = execute; Eq. 4-5 with argmax instead of Gumbel sampling).

    Raises:
        WideError: missing directory or files, a file where the directory is expected, corrupt files (a bad value in ``wide_config.json``, including
            group sizes that do not fit the model, or a field of ``base_model.json`` that is missing or of the
            wrong type, names the file and the field, before any weight loads; router weights that are not
            floating point or not finite), a
            checkpoint made for another base model, router keys or shapes that do not fit (the message counts and names
            the missing / unexpected keys; checked before any weight loads when ``base_model.json`` records the
            dims), a missing / corrupt LoRA
            adapter, or a device this machine does not have (:func:`wide.model.check_device`); a ``path``
            that is not a str / ``os.PathLike``, ``tokenizer=True`` with a loaded module as ``model``, a
            ``dtype`` other than bf16 / fp16 / fp32, and (with ``model=None``) a recorded base model that is no
            longer at its path (the message says to pass it as ``model`` / ``--model``).

    Warns:
        WideWarning: (a ``UserWarning``) the checkpoint is an intermediate save of a run that did not finish
            (``base_model.json`` records ``step < steps``); the message names the directory and the command that
            finishes the run (the CLI prints it as one line).
    """
    check_device(device)
    if not isinstance(path, (str, os.PathLike)):
        raise WideError(f"wide.load: path must be a WIDE checkpoint directory (str or os.PathLike), got "
                        f"{type(path).__name__} {path!r}")
    if tokenizer and isinstance(model, torch.nn.Module):
        raise WideError("wide.load: tokenizer=True loads the tokenizer with the base model, so model must be None or "
                        "a --model string, not an already loaded module (load its tokenizer with transformers)")
    path = Path(path)
    check_directory(path, "WIDE checkpoint", "the -o of `wide calibrate` or `wide lora`")
    config = WideConfig.load(path)
    info = read_base_info(path)
    saved = _saved_dims(info)
    if saved is not None:  # before any model loads; checked against the loaded model's dims below too
        _check_fits(config, saved, path)
    routers = read_safetensors(path / ROUTERS_NAME)  # fail on a corrupt file before loading any model
    if saved is not None:  # router keys and shapes that the recorded model and config need, before any weight
        _check_routers(routers, router_shapes(saved, config), path,
                       f"the dims recorded in {path / BASE_NAME} and the group sizes of {path / CONFIG_NAME}")
    for name, t in routers.items():  # a garbled payload parses but holds NaN / inf: unusable routers
        if not t.is_floating_point():  # router weights are float (fp32 as saved); an int tensor is not a router
            raise WideError(f"corrupt checkpoint file {path / ROUTERS_NAME}: tensor {name!r} is "
                            f"{str(t.dtype).replace('torch.', '')}; router weights are floating point")
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise WideError(f"corrupt checkpoint file {path / ROUTERS_NAME}: tensor {name!r} holds {bad} NaN or "
                            f"infinite values")
    extra = info.get("extra", {})  # step / steps / stage typed by read_base_info
    if "step" in extra and "steps" in extra and extra["step"] < extra["steps"]:
        command = {"router": "wide calibrate", "lora": "wide lora"}.get(extra.get("stage"), "the training command")
        warnings.warn(f"WIDE checkpoint {str(path)!r} is an intermediate save (step {extra['step']} of "
                      f"{extra['steps']}) of an interrupted {command} run; to finish it, run {command} again with "
                      f"the same options, -o {str(path)!r} and --resume", WideWarning, stacklevel=2)
    tok = None
    recorded = str(info["model"])
    if model is None and recorded != DEFAULT_MODEL and not Path(recorded).expanduser().exists():
        raise WideError(f"checkpoint {str(path)!r} records base model {recorded!r} ({BASE_NAME}), which is not "
                        f"there any more: give the base model explicitly (--model, or model= in Python)")
    # fp16 rounds the weights differently from the bf16 rounding that the fingerprint hashes, so an fp16 model is
    # loaded in fp32 on the CPU, checked, then cast (the CPU holds the fp32 copy for the time of the check)
    half = dtype == torch.float16 and not isinstance(model, torch.nn.Module)
    if isinstance(model, torch.nn.Module):
        base = model
    else:
        base, tok, _ = load_base_model(model if model is not None else info["model"],
                                       device="cpu" if half else device, dtype=torch.float32 if half else dtype,
                                       check=check, config_check=config_check)
    dims = dims_of(base.config)
    if info.get("dims") and info["dims"] != dims.__dict__:
        raise WideError(f"checkpoint {str(path)!r} was made for a model with dims {info['dims']}, "
                        f"this model has {dims.__dict__}")
    _check_fits(config, dims, path)  # group sizes that do not fit the model: an error naming the file
    saved_fp = str(info["fingerprint"])
    fp = fingerprint_like(base, saved_fp)
    if fp != saved_fp:
        hint = ""
        if next(base.parameters()).dtype == torch.float16:
            hint = ("; a model already loaded in float16 cannot be checked (its weights round differently): pass "
                    "model=None or a --model string with dtype=torch.float16, which loads, checks, then casts")
        raise WideError(f"checkpoint {str(path)!r} was made for base model {info['model']!r} "
                        f"(fingerprint {info['fingerprint']}), not this one (fingerprint {fp}){hint}")
    if half:
        base = base.to(device=torch.device(device) if device is not None else default_device(), dtype=torch.float16)
    wm = WideModel(base, config)
    _check_routers(routers, {k: tuple(v.shape) for k, v in wm.router_state_dict().items()}, path)
    wm.load_router_state_dict(routers)
    from wide.lora import ADAPTER_DIR, load_adapter

    if (path / ADAPTER_DIR).exists():
        load_adapter(wm, path / ADAPTER_DIR, merge=merge_lora)
    wm.eval()
    return (wm, tok) if tokenizer else wm
