"""WIDE checkpoint directories and :func:`load` (``wide.load``): ``routers.safetensors`` (float32, keys
``"attn.<layer>.w1.weight"``, ...), ``wide_config.json``, stage 2's ``adapter/`` (peft) and ``base_model.json``
(``model``, ``fingerprint``, ``architecture``, ``dims``, ``files``: each file's SHA-256, ``extra``) and, once the
logit shifts are fitted (:mod:`wide.calibrate`), ``calibration.json`` (applied on load unless ``calibrated=False``).
Files are written atomically and checked against their SHA-256 on load; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from pathlib import Path

import torch

from wide.config import CONFIG_NAME, ModelDims, WideConfig, atomic_write, atomic_write_text
from wide.errors import WideError, WideWarning
from wide.hub import DEFAULT_MODEL, check_device, default_device, load_base_model
from wide.lora import ADAPTER_DIR, load_adapter
from wide.model import WideModel, check_architecture, check_router_weights, dims_of, fingerprint, router_shapes

ROUTERS_NAME = "routers.safetensors"
BASE_NAME = "base_model.json"
CALIBRATION_NAME = "calibration.json"


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


#: base_model.json's fields -> (required, test, what is allowed); "extra.<key>": the facts a training run records
_FIELDS = {
    "model": (True, lambda v: isinstance(v, str) and v.strip(), "a non-empty string (the --model it was made with)"),
    "fingerprint": (True, lambda v: isinstance(v, str) and v.strip(), "a non-empty string (the base weights' hash)"),
    "architecture": (True, lambda v: isinstance(v, str), "a string (the base model's architecture class)"),
    "dims": (True, lambda v: isinstance(v, dict) and set(v) == set(ModelDims.__dataclass_fields__) and all(
        _is_count(x) and x > 0 for x in v.values()), "an object of the six model dims (num_layers, hidden_size, "
        "num_heads, num_kv_heads, head_dim, intermediate_size), each a positive integer"),
    "files": (True, lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
              "an object of file name -> SHA-256"),
    "extra": (False, lambda v: isinstance(v, dict), "an object (facts about the run that wrote the checkpoint)"),
    "extra.step": (False, _is_count, "an integer >= 0"),
    "extra.steps": (False, _is_count, "an integer >= 0"),
    "extra.stage": (False, lambda v: isinstance(v, str), "a string"),
    "extra.fit_bias": (False, lambda v: isinstance(v, bool), "true or false (whether the logit shift is fitted "
                                                            "after training)"),
}
_TOP = [k for k in _FIELDS if "." not in k]


def _json_kind(v) -> str:
    return (json.dumps(v) if v is None or isinstance(v, bool) else f"the number {v!r}" if isinstance(v, (int, float))
            else f"the string {v!r}"[:80] if isinstance(v, str) else "a list" if isinstance(v, list) else "an object")


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata=None) -> None:
    """Write a safetensors file atomically (:func:`wide.config.atomic_write`)."""
    from safetensors.torch import save_file

    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a safetensors file. Raises WideError naming it when it is missing, a directory or corrupt."""
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


def _hashes(directory: Path) -> dict[str, str]:
    """SHA-256 of each file a checkpoint holds: the routers, the config and every file of the adapter."""
    adapter = directory / ADAPTER_DIR
    names = [ROUTERS_NAME, CONFIG_NAME, CALIBRATION_NAME, *sorted(p.relative_to(directory).as_posix()
                                                for p in adapter.rglob("*") if p.is_file())]
    return {n: hashlib.sha256((directory / n).read_bytes()).hexdigest() for n in names if (directory / n).is_file()}


def save_wide(model: WideModel, directory: str | os.PathLike, model_ref: str, extra: dict | None = None,
              routers: dict[str, torch.Tensor] | None = None, base_fingerprint: str | None = None) -> Path:
    """Write routers, config and ``base_model.json`` (every file's SHA-256, so last) into ``directory``;
    ``model_ref`` loads the base again, ``extra`` holds run facts; ``routers`` and ``base_fingerprint`` come from
    the caller when the model is sharded."""
    directory = Path(directory)
    atomic_save_safetensors(model.router_state_dict() if routers is None else routers, directory / ROUTERS_NAME,
                            metadata={"format": "wide-routers-v1"})
    model.config.save(directory)
    info = {"model": model_ref, "fingerprint": base_fingerprint or fingerprint(model.base),
            "architecture": check_architecture(model.base.config), "dims": model.dims.__dict__,
            "files": _hashes(directory), **({"extra": extra} if extra else {})}
    atomic_write_text(directory / BASE_NAME, json.dumps(info, indent=2) + "\n")
    return directory


def read_base_info(directory: str | os.PathLike) -> dict:
    """``<directory>/base_model.json``, every field type-checked. Raises WideError naming the file and field."""
    path = Path(directory) / BASE_NAME
    if not path.is_file():
        raise WideError(f"no {BASE_NAME} in {str(directory)!r}: not a WIDE checkpoint directory")
    try:
        info = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise WideError(f"corrupt {path}: {e}") from None
    if not isinstance(info, dict):
        raise WideError(f"corrupt {path}: it holds {_json_kind(info)}; it must be a JSON object with the fields {_TOP}")
    unknown = sorted(map(str, set(info) - set(_TOP)))
    if unknown:
        raise WideError(f"corrupt {path}: unknown field(s) {unknown}; allowed: {_TOP}")
    for name, (required, ok, allowed) in _FIELDS.items():
        holder, key = (info.get("extra", {}), name[6:]) if name.startswith("extra.") else (info, name)
        if key not in holder:
            if required:
                raise WideError(f"corrupt {path}: field {name!r} is missing; it must be {allowed}")
        elif not ok(holder[key]):
            raise WideError(f"corrupt {path}: field {name!r} is {_json_kind(holder[key])}; it must be {allowed}")
    return info


def save_calibration(directory: str | os.PathLike, record: dict) -> Path:
    """Write a fitted record (:func:`wide.calibrate.fit_shifts`) to ``<directory>/calibration.json`` atomically,
    then record its SHA-256 in ``base_model.json``; returns the file's path."""
    directory = Path(directory)
    path = directory / CALIBRATION_NAME
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    info = read_base_info(directory)
    info["files"] = _hashes(directory)
    atomic_write_text(directory / BASE_NAME, json.dumps(info, indent=2) + "\n")
    return path


def _finite_list(v, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)


def read_calibration(directory: str | os.PathLike, config: WideConfig, dims: ModelDims) -> dict | None:
    """``<directory>/calibration.json`` checked against the routed modules (None when absent). Raises WideError
    naming the file and the field when it is malformed."""
    path = Path(directory) / CALIBRATION_NAME
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise WideError(f"corrupt {path}: {e}") from None
    L = dims.num_layers
    routed = [k for k, on in (("attn", config.route_attn), ("ffn", config.route_ffn)) if on]
    shifts = rec.get("module_shifts") if isinstance(rec, dict) else None
    checks = [("format", isinstance(rec, dict) and rec.get("format") == "wide-calibration-v1",
               '"wide-calibration-v1"'),
              ("module_shifts", isinstance(shifts, dict) and sorted(shifts) == sorted(routed) and all(
                  _finite_list(shifts[k], L) for k in routed), f"an object of {routed}, each a list of {L} finite "
                                                                f"numbers (one shift per layer)")]
    for name, ok, allowed in checks:
        if not ok:
            raise WideError(f"corrupt {path}: field {name!r} must be {allowed}")
    return rec


def check_directory(path: Path, what: str, expected: str) -> None:
    """Raises WideError when ``path`` (e.g. ``--wide``) is a file or missing instead of a checkpoint directory."""
    if path.is_file():
        inside = (f"; {path.name} is one of its files: give its folder {str(path.parent)!r}"
                  if path.name in (CONFIG_NAME, BASE_NAME, ROUTERS_NAME) else "")
        raise WideError(f"{what} {str(path)!r} is a file, but a checkpoint directory is expected ({expected}, "
                        f"holding {CONFIG_NAME}, {BASE_NAME} and {ROUTERS_NAME}){inside}")
    if not path.is_dir():
        raise WideError(f"{what} {str(path)!r} not found (expected {expected}, a directory with {CONFIG_NAME})")


def read_config(directory: str | os.PathLike, base: torch.nn.Module | ModelDims) -> WideConfig:
    """``<directory>/wide_config.json``, its group sizes checked against a Hugging Face model or dims."""
    config = WideConfig.load(directory)
    try:
        config.resolve(base if isinstance(base, ModelDims) else dims_of(base.config))
    except WideError as e:
        raise WideError(f"corrupt {Path(directory) / CONFIG_NAME}: {e}") from None
    return config


def _read_checked(path: Path, what: str, expected: str) -> tuple[WideConfig, dict, dict]:
    """Config, base info and routers of a checkpoint, checked against each other and their SHA-256s."""
    check_directory(path, what, expected)
    WideConfig.load(path)  # a malformed config is named before base_model.json
    info = read_base_info(path)
    saved = ModelDims(**info["dims"])
    config = read_config(path, saved)
    routers = read_safetensors(path / ROUTERS_NAME)
    try:
        check_router_weights(routers, router_shapes(saved, config))
    except WideError as e:
        now, recorded = _hashes(path), info["files"]
        changed = [f"{n} {'is not recorded in' if n not in recorded else 'does not match its SHA-256 in'} "
                   f"{BASE_NAME}" for n in (ROUTERS_NAME, CONFIG_NAME) if now.get(n) != recorded.get(n)]
        edits = f"; {' and '.join(changed)}: changed after it was saved" if changed else ""
        raise WideError(f"{path / ROUTERS_NAME}: {e} (the shapes it needs come from the dims recorded in "
                        f"{path / BASE_NAME} and the group sizes of {path / CONFIG_NAME}{edits})") from None
    now, recorded = _hashes(path), info["files"]
    for name in sorted(set(now) | set(recorded)):
        if now.get(name) != recorded.get(name):
            why = ("is missing" if name not in now else f"is not recorded in {BASE_NAME}" if name not in recorded
                   else f"does not match its SHA-256 in {BASE_NAME}: it changed after it was saved")
            if name == CALIBRATION_NAME and name not in recorded:
                why += (" (a fit stopped while saving): delete it to load the routers as trained, or run `wide "
                        "calibrate` (or `wide lora`) -o on this folder with --resume to fit again")
            raise WideError(f"corrupt checkpoint file {path / name}: {why}")
    for name, t in routers.items():
        if not bool(torch.isfinite(t).all()):
            raise WideError(f"corrupt checkpoint file {path / ROUTERS_NAME}: tensor {name!r} holds "
                            f"{int((~torch.isfinite(t)).sum())} NaN or infinite values")
    return config, info, routers


def check_stage1(path: str | os.PathLike) -> dict:
    """Check a stage-1 checkpoint before any model loads; return its ``base_model.json``. Raises WideError for a
    missing or corrupt checkpoint or one that already holds a LoRA adapter."""
    path = Path(path)
    _, info, _ = _read_checked(path, "stage-1 checkpoint", "the -o of `wide calibrate`")
    if (path / ADAPTER_DIR).exists():
        raise WideError(f"{str(path)!r} already holds a LoRA adapter; give the stage-1 (router-only) checkpoint")
    return info


def load(path: str | os.PathLike, model: str | torch.nn.Module | None = None, device=None, dtype=None,
         tokenizer: bool = False, merge_lora: bool = False, check=None, config_check=None, calibrated: bool = True,
         sparsity: float | None = None, sparsity_unit: str | None = None, text: str | None = None):
    """Load a saved WIDE model for inference (argmax routing, Eq. 5); every file (type, fields, shapes, SHA-256) is
    checked before any base weight is read.

    Args:
        path: a directory of ``wide calibrate`` / ``wide lora``. model: None (the recorded base model), a
            ``--model`` string, or a loaded model. device: default CUDA when available. dtype: of the base (default
            bf16 on a GPU, fp32 on the CPU; fp16 is checked in fp32 on the CPU, then cast); routers stay fp32.
        tokenizer: also return the tokenizer. merge_lora: fold a stage-2 adapter into the base weights.
        check, config_check: :func:`wide.hub.load_base_model`'s hooks, run before the weights load.
        calibrated: apply the fitted logit shifts of ``calibration.json`` (when there); False: the routers as
            trained (the paper's routing), which a dial (``sparsity``) would replace, so the two exclude each other.
        sparsity: dial the routers to realize this sparsity in ``[0, 1)`` without training
            (:func:`wide.calibrate.dial`, a few forward passes over the held-out part of ``text``, default the
            bundled calibration text), in ``sparsity_unit`` (``"groups"`` or ``"flops"``; default the config's).
            ``model.calibration`` holds the record of what was fitted and realized.

    Returns:
        a :class:`WideModel` in eval mode (and the tokenizer): ``model(input_ids)`` with int64 ``[B, T]`` ids
        gives logits ``[B, T, vocab]``; each layer's masks are bool ``[B, T, N_G]``.

    Raises:
        WideError: bad arguments (``tokenizer`` / ``merge_lora`` / ``calibrated`` not a bool, a ``sparsity``
            outside ``[0, 1)`` or above the checkpoint's ``max_module_sparsity``, ``sparsity`` with
            ``calibrated=False``, an unknown unit, ``text`` without ``sparsity`` or a text that cannot be read),
            a missing or changed file
            (naming it), another base model, or a missing device.
        Warns WideWarning for an intermediate save of an unfinished run, or for a finished run whose planned
        logit-shift fit was not saved (``extra.fit_bias`` true, no ``calibration.json``) when it loads calibrated.
    """
    check_device(device)
    if not isinstance(path, (str, os.PathLike)):
        raise WideError(f"wide.load: path must be a WIDE checkpoint directory (str or os.PathLike), got "
                        f"{type(path).__name__} {path!r}")
    if not os.fspath(path):
        raise WideError("wide.load: path is empty; give a WIDE checkpoint directory")
    if tokenizer and isinstance(model, torch.nn.Module):
        raise WideError("wide.load: tokenizer=True loads the tokenizer with the base model, so model must be None or "
                        "a --model string, not an already loaded module (load its tokenizer with transformers)")
    for name, value in (("tokenizer", tokenizer), ("merge_lora", merge_lora), ("calibrated", calibrated)):
        if not isinstance(value, bool):
            raise WideError(f"wide.load: {name} must be True or False, got {type(value).__name__} {value!r}")
    if sparsity is not None or sparsity_unit is not None:
        from wide.calibrate import check_target, check_unit
        if sparsity_unit is not None:
            check_unit(sparsity_unit)
        if sparsity is None:
            raise WideError("wide.load: sparsity_unit is the unit of a dialed sparsity: give sparsity= too")
        check_target(sparsity, "wide.load: sparsity")
        if not calibrated:
            raise WideError(f"wide.load: calibrated=False and sparsity={sparsity!r} exclude each other: the dial "
                            f"replaces the fitted shift whether or not it was applied; give sparsity= for a dialed "
                            f"model or calibrated=False for the routers as trained")
    if text is not None:
        if sparsity is None:
            raise WideError("wide.load: text is the text a dialed sparsity is fitted on: give sparsity= too")
        from wide.data import load_texts
        load_texts(text, split="calib")  # a missing, empty or structured text is named before any weight loads
    path = Path(path)
    config, info, routers = _read_checked(path, "WIDE checkpoint", "the -o of `wide calibrate` or `wide lora`")
    calibration = read_calibration(path, config, ModelDims(**info["dims"]))
    if sparsity is not None:
        from wide.calibrate import check_reachable
        check_reachable(sparsity, config.max_module_sparsity, sparsity_unit or config.sparsity_unit,
                        "wide.load: sparsity", f"the max_module_sparsity of {str(path)!r}",
                        f"give sparsity {config.max_module_sparsity:g} or less")
    extra = info.get("extra", {})
    command = {"router": "wide calibrate", "lora": "wide lora"}.get(extra.get("stage"), "the training command")
    if "step" in extra and "steps" in extra and extra["step"] < extra["steps"]:
        warnings.warn(f"WIDE checkpoint {str(path)!r} is an intermediate save (step {extra['step']} of "
                      f"{extra['steps']}) of an interrupted {command} run; to finish it, run {command} again with "
                      f"the same options, -o {str(path)!r} and --resume", WideWarning, stacklevel=2)
    elif extra.get("fit_bias") is True and calibration is None and calibrated and sparsity is None:
        warnings.warn(f"WIDE checkpoint {str(path)!r} has no {CALIBRATION_NAME}: its {command} run finished "
                      f"training but stopped before the logit-shift fit was saved, so it loads uncalibrated (the "
                      f"routers as trained); to finish the fit, run {command} -o {str(path)!r} --resume",
                      WideWarning, stacklevel=2)
    recorded = info["model"]
    if model is None and recorded != DEFAULT_MODEL and not Path(recorded).expanduser().exists():
        raise WideError(f"checkpoint {str(path)!r} records base model {recorded!r} ({BASE_NAME}), which is not "
                        f"there any more: give the base model explicitly (--model, or model= in Python)")
    tok = None
    half = dtype == torch.float16 and not isinstance(model, torch.nn.Module)  # fp16 rounds unlike the fingerprint
    if isinstance(model, torch.nn.Module):
        base = model
    else:
        base, tok, _ = load_base_model(recorded if model is None else model, device="cpu" if half else device,
                                       dtype=torch.float32 if half else dtype, check=check, config_check=config_check)
    if dims_of(base.config).__dict__ != info["dims"]:
        raise WideError(f"checkpoint {str(path)!r} was made for a model with dims {info['dims']}, "
                        f"this model has {dims_of(base.config).__dict__}")
    fp = fingerprint(base)
    if fp != info["fingerprint"]:
        hint = ("; a model already loaded in float16 cannot be checked (its weights round differently): pass "
                "model=None or a --model string with dtype=torch.float16, which loads, checks, then casts"
                if next(base.parameters()).dtype == torch.float16 else "")
        raise WideError(f"checkpoint {str(path)!r} was made for base model {recorded!r} "
                        f"(fingerprint {info['fingerprint']}), not this one (fingerprint {fp}){hint}")
    if half:
        base = base.to(device=torch.device(device) if device is not None else default_device(), dtype=torch.float16)
    wm = WideModel(base, config)
    wm.load_router_state_dict(routers)
    if (path / ADAPTER_DIR).exists():
        load_adapter(wm, path / ADAPTER_DIR, merge=merge_lora)
    wm.eval()
    if calibration is not None and calibrated:
        wm.set_router_shifts(calibration["module_shifts"])
        wm.calibration = calibration  # with a dial: its curve starts the fit
    if sparsity is not None:
        from wide.calibrate import dial
        from wide.hub import load_tokenizer, resolve_model
        dial(wm, sparsity, tok if tok is not None else load_tokenizer(resolve_model(recorded if model is None
                                                                                     or not isinstance(model, str)
                                                                                     else model)),
             unit=sparsity_unit, text=text)
    return (wm, tok) if tokenizer else wm
