"""lm-evaluation-harness integration (paper §4.1 "Evaluation"): importing this module registers the lm-eval model
type ``wide`` (:class:`WideLM`, argmax routing, Eq. 5), which ``wide eval`` (:func:`evaluate`) and ``wide lm-eval``
(:func:`lm_eval_main`, lm-eval's own command line with our offline tasks) run; lm-eval has no plugin discovery."""

from __future__ import annotations

import math
import sys

import lm_eval
import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from wide.checkpoint import load
from wide.errors import WideError
from wide.eval.perplexity import SparsityMeter
from wide.eval.tasks import ALL_TASKS, PAPER_METRIC, TASKS_DIR, WIKITEXT_TASK, ZEROSHOT_TASKS
from wide.hub import load_base_model
from wide.model import RoutingRecord, WideModel

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def _flag(name: str, value) -> bool:
    """A bool model argument: a bool, or lm-eval's ``--model_args`` string ``true`` / ``false`` (also 1 / 0, yes / no).
    Raises WideError for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise WideError(f"{name}={value!r} must be true or false")


@register_model("wide")
class WideLM(HFLM):
    """lm-eval model ``wide``: ``pretrained`` (``--model`` syntax or a loaded HF causal LM; default the checkpoint's
    base) with the routers of ``wide`` (a WIDE / SkipGPT checkpoint folder or a :class:`WideModel`; None = dense),
    argmax routing; ``merge_lora`` folds a stage-2 adapter into the weights; ``calibrated`` (default True) applies
    the checkpoint's fitted logit shift; ``sparsity`` (``[0, 1)``, e.g. ``--model_args wide=CKPT,sparsity=0.3``)
    dials the routers to it, in ``sparsity_unit`` (groups / flops; default the checkpoint's), without training;
    other keywords are ``HFLM``'s.

    Lm-eval's loglikelihood batches are right-padded without a mask: causal attention and per-token routers keep
    real tokens blind to the padding, and the realized sparsity counts real tokens only (:meth:`_select_cont_toks`).
    Raises WideError for bad paths, a checkpoint of another base model, a bad dtype, objects without a tokenizer.
    """

    #: at most this many tokens per rolling-loglikelihood batch (its logits are [batch, max_length, vocab])
    ROLLING_TOKENS = 16384

    def __init__(self, pretrained=None, wide=None, tokenizer=None, device=None, dtype=None, merge_lora=True,
                 batch_size=1, max_batch_size: int = 64, max_length: int | None = None, calibrated=True,
                 sparsity=None, sparsity_unit=None, **kwargs) -> None:
        if dtype not in (None, "auto") and not isinstance(dtype, torch.dtype) and str(dtype) not in _DTYPES:
            raise WideError(f"dtype {dtype!r} is not one of {', '.join(sorted(_DTYPES))}, auto")
        dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype))
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's command line asks cuda:0 by default
        if isinstance(sparsity, str):  # lm-eval's --model_args give strings
            try:
                sparsity = float(sparsity)
            except ValueError:
                raise WideError(f"sparsity {sparsity!r} is not a number; give a fraction in [0, 1), e.g. 0.5") from None
        if sparsity is not None and wide is None:
            raise WideError(f"sparsity={sparsity!r} dials the routers of a WIDE checkpoint: give wide=CKPT")
        calibrated, merge_lora = _flag("calibrated", calibrated), _flag("merge_lora", merge_lora)
        wm, tok, loaded = wide if isinstance(wide, WideModel) else None, None, isinstance(pretrained, torch.nn.Module)
        if wm is not None and sparsity is not None:
            raise WideError("sparsity= dials a checkpoint as it loads: give wide= a checkpoint folder, or dial the "
                            "WideModel first (wide.calibrate.dial)")
        if wide is not None and wm is None:
            kw = {"model": pretrained, "merge_lora": merge_lora, "calibrated": calibrated,
                  "sparsity": sparsity, "sparsity_unit": sparsity_unit}
            wm, tok = (load(str(wide), **kw), None) if loaded else load(str(wide), device=device, dtype=dtype,
                                                                        tokenizer=True, **kw)
        base = wm.base if wm is not None else pretrained
        if wm is None and not loaded:
            base, tok, _ = load_base_model(pretrained, device=device, dtype=dtype)
        tokenizer = tokenizer if tokenizer is not None else tok
        if tokenizer is None:
            raise WideError("WideLM got a model object without a tokenizer: pass tokenizer=")
        super().__init__(pretrained=base, tokenizer=tokenizer, batch_size=batch_size,
                         max_batch_size=max_batch_size, max_length=max_length, **kwargs)
        self.wide_model = wm
        self.wide_path = None if wm is None or isinstance(wide, WideModel) else str(wide)
        self.reset_sparsity()

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """``HFLM``'s rolling log-likelihood with batches cut to :attr:`ROLLING_TOKENS` tokens (same scores)."""
        saved = self.batch_size_per_gpu
        if isinstance(saved, int):
            self.batch_size_per_gpu = max(1, min(saved, self.ROLLING_TOKENS // max(1, self.max_length)))
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self.batch_size_per_gpu = saved

    def reset_sparsity(self) -> None:
        """Start a new realized-sparsity count."""
        self._meter = SparsityMeter(self.wide_model.dims.num_layers) if self.wide_model is not None else None
        self._pending, self._row, self._tokens, self._rows = None, 0, 0, 0

    def sparsity_report(self) -> dict | None:
        """:meth:`SparsityMeter.report` over the real tokens scored so far (context: their mean length), plus
        ``tokens`` and ``sequences``; None for a dense model."""
        if self._meter is None or not self._tokens:
            return None if self._meter is None else {"tokens": 0, "sequences": 0}
        ctx = max(1, round(self._tokens / self._rows))
        return {**self._meter.report(self.wide_model, ctx), "tokens": self._tokens, "sequences": self._rows}

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits ``[B, T, V]`` of int64 ``inps`` ``[B, T]`` through the routed model; keeps each kind's kept
        groups summed over the first t + 1 tokens (float64 ``[L, B, T]``) for :meth:`_select_cont_toks`."""
        wm = self.wide_model
        if wm is None or attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        wm.stochastic, wm.record_masks = False, True
        try:
            with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                                 enabled=self.mixed_precision_dtype is not None):
                logits = wm(inps).logits
        finally:
            wm.record_masks = False
        masks = wm.record.masks
        self._pending = {kind: torch.stack([masks[(kind, i)].sum(-1, dtype=torch.float64)
                                            for i in range(wm.dims.num_layers)]).cumsum(-1).cpu()
                         for kind in ("attn", "ffn") if (kind, 0) in masks}
        wm.record, self._row = RoutingRecord(), 0
        return logits

    def _select_cont_toks(self, logits: torch.Tensor, contlen=None, inplen=None) -> torch.Tensor:
        """``HFLM``'s continuation slice; also counts the routing of the row's ``inplen`` real tokens (``HFLM``
        calls it once per row of the last :meth:`_model_call`, in order)."""
        if self._pending is not None and inplen is not None:
            wm, n = self.wide_model, int(inplen)
            for kind, kept in self._pending.items():
                n_groups = wm.n_attn_groups if kind == "attn" else wm.n_ffn_groups
                self._meter.add(kind, kept[:, self._row, n - 1].tolist(), n * n_groups)
            self._tokens, self._rows, self._row = self._tokens + n, self._rows + 1, self._row + 1
        return super()._select_cont_toks(logits, contlen=contlen, inplen=inplen)

    def get_model_info(self) -> dict:
        """``HFLM``'s model facts plus the WIDE checkpoint, its config and the realized sparsity."""
        info = super().get_model_info()
        if self.wide_model is not None:
            rep = self.sparsity_report() or {}
            info.update({"wide_checkpoint": self.wide_path, "wide_config": self.wide_model.config.to_dict(),
                         **{k: rep[k] for k in ("groups_sparsity", "flops_sparsity", "flops_context", "attn_sparsity",
                                                "ffn_sparsity", "realized_sparsity", "flop_weighted_sparsity",
                                                "calibration", "tokens") if k in rep}})
        return info


def resolve_tasks(spec: str | list[str]) -> list[str]:
    """Full task names (``wide_...``, each once, in order) of a comma list of ``all``, ``zeroshot``, short or full
    names; WideError for none or an unknown one, listing the known ones."""
    names = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec) if t.strip()]
    short = ", ".join(t.removeprefix("wide_") for t in ALL_TASKS)
    known = f"all, zeroshot, {short} (each also with the prefix wide_, e.g. wide_arc_easy)"
    if not names:
        raise WideError(f"no task given; known: {known}")
    groups, out = {"all": ALL_TASKS, "zeroshot": ZEROSHOT_TASKS, "wide_zeroshot": ZEROSHOT_TASKS}, []
    for n in names:
        full = n if n.startswith("wide_") else f"wide_{n}"
        if n not in groups and full not in ALL_TASKS:
            raise WideError(f"unknown task {n!r}; known: {known}")
        out += groups.get(n, [full])
    return list(dict.fromkeys(out))


def task_manager(metadata: dict | None = None):
    """An lm-eval ``TaskManager`` over our task YAMLs alone (lm-eval's own index takes seconds to build)."""
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata or {})


def summarize(results: dict) -> dict:
    """``lm_eval.simple_evaluate`` results flattened: the paper's metric per task (``arc_easy``, ...), ``<task>_n``,
    ``<task>_stderr`` (lm-eval's, or ``sqrt(p (1 - p) / (n - 1))`` without bootstrap), ``avg_acc`` over all seven,
    ``wikitext_word_ppl`` / ``_byte_ppl`` / ``_bits_per_byte``."""
    res = results.get("results", {})
    out: dict = {}
    for task, (key, metric) in PAPER_METRIC.items():
        if f"{metric},none" not in res.get(task, {}):
            continue
        p = out[key] = float(res[task][f"{metric},none"])
        se = res[task].get(f"{metric}_stderr,none")
        n = res[task].get("sample_len") or results.get("n-samples", {}).get(task, {}).get("effective")
        if n:
            out[f"{key}_n"] = int(n)
        if isinstance(se, (int, float)) and not math.isnan(se):
            out[f"{key}_stderr"] = float(se)
        elif n and n > 1:
            out[f"{key}_stderr"] = math.sqrt(p * (1.0 - p) / (n - 1))
    keys = [k for k, _ in PAPER_METRIC.values()]
    if all(k in out for k in keys):
        out["avg_acc"] = sum(out[k] for k in keys) / len(keys)
    if WIKITEXT_TASK in res:
        for name in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            out[f"wikitext_{name.replace('perplexity', 'ppl')}"] = float(res[WIKITEXT_TASK][f"{name},none"])
    return out


def evaluate(lm: WideLM, tasks: str | list[str], limit: int | float | None = None, wikitext_path: str | None = None,
             bootstrap_iters: int = 100000, log_samples: bool = False) -> dict:
    """Zero-shot lm-eval of ``lm`` on our offline tasks (:func:`resolve_tasks`), ``limit`` documents per task (or a
    fraction): ``{"summary": summarize(...), "sparsity": lm.sparsity_report(), "results": <lm-eval's>}``. Raises
    WideError for unknown tasks, a bad ``limit``, missing task data."""
    names = resolve_tasks(tasks)
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise WideError(f"limit {limit!r} must be a positive number of documents (or a fraction)")
    lm.reset_sparsity()
    results = lm_eval.simple_evaluate(
        model=lm, tasks=names, num_fewshot=0, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=log_samples,
        task_manager=task_manager({"wikitext_path": wikitext_path} if wikitext_path else None), random_seed=0,
        numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)
    return {"summary": summarize(results), "sparsity": lm.sparsity_report(), "results": results}


def lm_eval_main(argv: list[str] | None = None) -> int:
    """lm-eval's command line (``argv``: its own arguments) with ``wide`` registered and our tasks on
    ``--include_path``. An exception inside lm-eval is one line ``wide lm-eval: error: ...`` and returns 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in args:
        args += ["--include_path", str(TASKS_DIR)]
    old, sys.argv = sys.argv, ["lm-eval", *args]
    try:
        cli_evaluate()
    except Exception as e:  # noqa: BLE001 - any failure inside lm-eval is reported as one line
        msg = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")  # its first line
        msg = msg if isinstance(e, ValueError) and msg else f"{type(e).__name__}: {msg}".removesuffix(": ")
        print(f"wide lm-eval: error: {msg}", file=sys.stderr)
        return 2
    finally:
        sys.argv = old
    return 0


if __name__ == "__main__":
    raise SystemExit(lm_eval_main())
