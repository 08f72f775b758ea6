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

from .config import CONFIG_NAME, ModelDims, WideConfig, atomic_write, atomic_write_text
from .errors import WideError
from .modeling import WideModel, check_architecture, check_device, dims_of, fingerprint, load_base_model

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
        base_fingerprint: the base model's :func:`~wide.modeling.fingerprint`, if already computed
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


def read_base_info(directory: str | os.PathLike) -> dict:
    path = Path(directory) / BASE_NAME
    if not path.is_file():
        raise WideError(f"no {BASE_NAME} in {str(directory)!r}: not a WIDE checkpoint directory")
    try:
        info = json.loads(path.read_text())
        info["model"], info["fingerprint"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise WideError(f"corrupt {path}: {e}") from None
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


def _saved_dims(info: dict) -> ModelDims | None:
    """The ``dims`` recorded in ``base_model.json`` as ModelDims, or None if absent or not positive integers."""
    d = info.get("dims")
    if not isinstance(d, dict) or set(d) != {f.name for f in dataclasses.fields(ModelDims)}:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in d.values()):
        return None
    return ModelDims(**d)


def _check_fits(config: WideConfig, dims, directory: str | os.PathLike) -> None:
    """``config.resolve(dims)``; its WideError (a group size that does not fit) is prefixed with the file."""
    try:
        config.resolve(dims)
    except WideError as e:
        raise WideError(f"corrupt {Path(directory) / CONFIG_NAME}: {e}") from None


def load(path: str | os.PathLike, model: str | torch.nn.Module | None = None, device=None, dtype=None,
         tokenizer: bool = False, merge_lora: bool = False, check=None):
    """Load a saved WIDE model, ready for evaluation (argmax routing).

    Args:
        path: a directory written by :func:`save_wide` (``wide calibrate`` / ``wide lora`` output).
        model: ``None`` to load the base model recorded in the checkpoint, a ``--model`` string, or an
            already loaded Hugging Face model.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``; default CUDA when available.
        dtype: the base model's parameter dtype (``torch.bfloat16`` / ``float16`` / ``float32``); default
            bf16 on a GPU, fp32 on the CPU. The routers stay fp32 whatever the dtype.
        tokenizer: also return the tokenizer (then ``model`` must not be a module).
        merge_lora: if the directory holds a stage-2 LoRA adapter (``adapter/``, peft format), fold it into
            the base weights with peft's own merge and scale (``lora_alpha / r``); otherwise (default) keep
            it as separate peft LoRA layers. Either way the routing hooks gate the adapted projections.
        check: optional callable ``f(hf_config, tokenizer)`` run after the checkpoint's own files are checked
            and before any base weight is read (:func:`wide.modeling.load_base_model`'s hook), e.g. to validate
            sizes against the model's context; not called when ``model`` is an already loaded module.

    Returns:
        :class:`WideModel` (or ``(WideModel, tokenizer)``) in eval mode. Calling it as a Hugging Face
        causal LM, ``model(input_ids)`` with int64 ``input_ids [B, T]`` (optional ``attention_mask [B, T]``),
        returns logits ``[B, T, vocab]`` in the model dtype; each token's routing decisions are bool
        ``[B, T, N_G]`` masks per layer (True = execute; Eq. 4-5 with argmax instead of Gumbel sampling).

    Raises:
        WideError: missing directory or files, corrupt files (a bad value in ``wide_config.json``, including
            group sizes that do not fit the model, names the file; router weights that are not finite), a
            checkpoint made for another base model, router shapes that do not fit, a missing / corrupt LoRA
            adapter, or a device this machine does not have (:func:`wide.modeling.check_device`).

    Warns:
        UserWarning: the checkpoint is an intermediate save of a run that did not finish (``base_model.json``
            records ``step < steps``).
    """
    check_device(device)
    path = Path(path)
    if not path.is_dir():
        raise WideError(f"WIDE checkpoint {str(path)!r} not found (expected a directory with {CONFIG_NAME})")
    config = WideConfig.load(path)
    info = read_base_info(path)
    saved = _saved_dims(info)
    if saved is not None:  # before any model loads; checked against the loaded model's dims below too
        _check_fits(config, saved, path)
    routers = read_safetensors(path / ROUTERS_NAME)  # fail on a corrupt file before loading any model
    for name, t in routers.items():  # a garbled payload parses but holds NaN / inf: unusable routers
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise WideError(f"corrupt checkpoint file {path / ROUTERS_NAME}: tensor {name!r} holds {bad} NaN or "
                            f"infinite values")
    extra = info.get("extra") or {}
    if isinstance(extra.get("step"), int) and isinstance(extra.get("steps"), int) and extra["step"] < extra["steps"]:
        warnings.warn(f"WIDE checkpoint {str(path)!r} was saved at step {extra['step']} of {extra['steps']}: an "
                      f"interrupted {extra.get('stage', 'training')} run (the same command with --resume "
                      f"continues it)", stacklevel=2)
    tok = None
    if isinstance(model, torch.nn.Module):
        base = model
    else:
        base, tok, _ = load_base_model(model if model is not None else info["model"], device=device, dtype=dtype,
                                       check=check)
    dims = dims_of(base.config)
    if info.get("dims") and info["dims"] != dims.__dict__:
        raise WideError(f"checkpoint {str(path)!r} was made for a model with dims {info['dims']}, "
                        f"this model has {dims.__dict__}")
    _check_fits(config, dims, path)  # group sizes that do not fit the model: an error naming the file
    saved_fp = str(info["fingerprint"])
    fp = fingerprint(base, version=2 if saved_fp.startswith("v2:") else 1)
    if fp != saved_fp:
        raise WideError(f"checkpoint {str(path)!r} was made for base model {info['model']!r} "
                        f"(fingerprint {info['fingerprint']}), not this one (fingerprint {fp})")
    wm = WideModel(base, config)
    wm.load_router_state_dict(routers)
    from .lora import ADAPTER_DIR, load_adapter

    if (path / ADAPTER_DIR).exists():
        load_adapter(wm, path / ADAPTER_DIR, merge=merge_lora)
    wm.eval()
    return (wm, tok) if tokenizer else wm
