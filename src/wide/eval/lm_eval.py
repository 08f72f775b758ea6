"""lm-evaluation-harness integration (paper §4.1 "Evaluation"): the ``wide`` model type and a runner.

Importing this module registers the lm-eval model type ``wide`` (:class:`WideLM`, a subclass of lm-eval's
``HFLM``). lm-eval 0.4.13 has no plugin discovery for external model types (no entry points, no
``--include_package``), so the registration happens when something imports this module:

* ``wide eval --tasks ... [--wide CKPT] [--model M]`` (a shortcut that runs :func:`evaluate`), or
* ``wide lm-eval ARGS`` / ``python -m wide.eval.lm_eval ARGS``: lm-eval's own command line with
  ``wide`` registered and this package's offline tasks (:mod:`wide.eval.tasks`) on the include path, e.g.
  ``wide lm-eval --model wide --model_args pretrained=smollm2-135m,wide=runs/s50 --tasks wide_zeroshot``.

Model arguments of ``wide`` (``--model_args``): ``pretrained`` (base model: ``smollm2-135m`` = the bundled
GGUF, a HF checkpoint directory, e.g. a ``wide prune-static`` output, or a ``.gguf`` file; default: the
model recorded in the WIDE checkpoint, else ``smollm2-135m``), ``wide`` (a WIDE / SkipGPT checkpoint
directory, stage 1 or stage 2; omit for the dense model), ``merge_lora`` (default true: fold a stage-2
LoRA adapter into the weights through :func:`wide.load`), ``device``,
``dtype`` (``bfloat16``/``float16``/``float32``), ``batch_size``, ``max_length`` and the other ``HFLM``
options. The base model is loaded by :func:`wide.model.load_base_model` (so the GGUF works) and handed
to ``HFLM`` as a model object.

Routing is argmax (deterministic, Eq. 5). lm-eval scores loglikelihood requests on right-padded
batches without an attention mask: causal attention keeps every real token blind to the padding after
it and each router reads only its own token's residual stream, so padding changes neither the routing
nor the scores of real tokens; batch size 1 and 8 give the same accuracy (tested). Realized sparsity is
counted over real tokens only: :meth:`WideLM._select_cont_toks` learns each row's real length.
"""

from __future__ import annotations

import math
import sys

import torch
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.huggingface import HFLM

from wide.errors import WideError
from wide.eval.perplexity import SparsityMeter
from wide.eval.tasks import ALL_TASKS, PAPER_METRIC, TASKS_DIR, WIKITEXT_TASK, ZEROSHOT_TASKS
from wide.model import RoutingRecord, WideModel

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def _dtype(value) -> torch.dtype | None:
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return value if isinstance(value, torch.dtype) else None
    if str(value) not in _DTYPES:
        raise WideError(f"dtype {value!r} is not one of {', '.join(sorted(_DTYPES))}, auto")
    return _DTYPES[str(value)]


def _register() -> None:
    # Registering twice (module re-import) with the same class is a no-op in lm-eval's registry.
    if "wide" not in model_registry or model_registry.get("wide") is not WideLM:
        register_model("wide")(WideLM)


class WideLM(HFLM):
    """lm-eval model type ``wide``: a base model with (optionally) WIDE / SkipGPT routers, argmax routing.

    Args:
        pretrained: base model spec (``--model`` syntax), an already loaded HF causal LM, or ``None``
            (the checkpoint's recorded model, else the bundled SmolLM2-135M).
        wide: a WIDE / SkipGPT checkpoint directory or an already built :class:`WideModel`; ``None`` =
            dense.
        tokenizer: needed when ``pretrained`` / ``wide`` are objects; loaded otherwise.
        device: ``cpu``/``cuda``/``cuda:N``; default (and for a CUDA device on a machine without CUDA, as
            lm-eval's command line asks ``cuda:0`` by default): CUDA when available, else CPU.
        dtype: weights' dtype; default bfloat16 on CUDA, float32 on CPU.
        merge_lora: for a checkpoint with a stage-2 LoRA adapter (``wide lora``): fold it into the base
            weights with peft's merge (default ``True``: faster, same function) or keep peft's layers.
        batch_size, max_batch_size, max_length, **kwargs: ``HFLM`` options (``parallelize`` is not
            supported with a model object).

    Raises:
        WideError: bad paths, a checkpoint for another base model, a bad dtype, or object arguments
            without a tokenizer.
    """

    def __init__(self, pretrained=None, wide=None, tokenizer=None, device: str | None = None, dtype=None,
                 merge_lora=None, batch_size: int | str = 1, max_batch_size: int = 64,
                 max_length: int | None = None, **kwargs) -> None:
        from wide.checkpoint import load
        from wide.model import load_base_model

        tdtype = _dtype(dtype)
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # as HFLM: lm-eval's CLI defaults to cuda:0; without CUDA use the CPU
        wm = None
        if isinstance(wide, WideModel):
            wm, base = wide, wide.base
        elif wide is not None:
            load_kwargs = {"merge_lora": True if merge_lora is None else bool(merge_lora)}
            if isinstance(pretrained, torch.nn.Module):
                wm = load(str(wide), model=pretrained, **load_kwargs)
            else:
                wm, tok = load(str(wide), model=pretrained, device=device, dtype=tdtype, tokenizer=True, **load_kwargs)
                tokenizer = tokenizer if tokenizer is not None else tok
            base = wm.base
        elif isinstance(pretrained, torch.nn.Module):
            base = pretrained
        else:
            base, tok, _ = load_base_model(pretrained, device=device, dtype=tdtype)
            tokenizer = tokenizer if tokenizer is not None else tok
        if tokenizer is None:
            raise WideError("WideLM got a model object without a tokenizer: pass tokenizer=")
        super().__init__(pretrained=base, tokenizer=tokenizer, batch_size=batch_size,
                         max_batch_size=max_batch_size, max_length=max_length, **kwargs)
        self.wide_model = wm
        self.wide_path = None if wm is None or isinstance(wide, WideModel) else str(wide)
        self.reset_sparsity()

    # --- rolling log-likelihood (WikiText-2 word perplexity) ----------------------------------
    ROLLING_TOKENS = 16384

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """lm-eval's rolling log-likelihood with the batch cut to at most ``ROLLING_TOKENS`` tokens.

        Rolling windows are ``max_length`` tokens long, so the zero-shot batch size would hold
        ``[batch, max_length, vocab]`` logits: 24 GiB in bf16 at batch 64, 4096 tokens and SmolLM2's 49,152
        words, then as much again for the log-softmax. Each window is scored on its own, so the batch size
        changes no result beyond rounding.

        Returns:
            one summed log-likelihood (float, nats) per request, as ``HFLM.loglikelihood_rolling``.
        """
        saved = self.batch_size_per_gpu
        if isinstance(saved, int):
            self.batch_size_per_gpu = max(1, min(saved, self.ROLLING_TOKENS // max(1, self.max_length)))
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self.batch_size_per_gpu = saved

    # --- sparsity accounting ------------------------------------------------------------------
    def reset_sparsity(self) -> None:
        """Start a new realized-sparsity count (called at construction)."""
        self._meter = SparsityMeter(self.wide_model.dims.num_layers) if self.wide_model is not None else None
        self._pending: dict | None = None
        self._row = 0
        self._tokens = 0
        self._rows = 0

    def sparsity_report(self) -> dict | None:
        """Realized sparsity over every real (non-padding) token scored so far, or ``None`` when dense.

        Returns:
            :meth:`wide.eval.perplexity.SparsityMeter.report` fields (``attn_sparsity``, ``ffn_sparsity``,
            ``realized_sparsity`` = mean over the 2N routed modules as in Eq. 6, ``flop_weighted_sparsity``,
            ``per_layer``) plus ``tokens`` (real tokens counted) and ``sequences``; the FLOP weighting uses
            the mean sequence length as the context.
        """
        if self._meter is None:
            return None
        if not self._tokens:
            return {"tokens": 0, "sequences": 0}
        ctx = max(1, round(self._tokens / self._rows))
        return {**self._meter.report(self.wide_model, ctx), "tokens": self._tokens, "sequences": self._rows}

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]`` of a right-padded batch ``inps`` (int64 ``[B, T]``) through the routed model.

        Dense models use ``HFLM``'s own call. For a WIDE model the per-token keep masks are kept until
        :meth:`_select_cont_toks` tells each row's real length.
        """
        if self.wide_model is None or attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        wm = self.wide_model
        wm.stochastic = False
        wm.record_masks = True
        try:
            with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                                 enabled=self.mixed_precision_dtype is not None):
                logits = wm(inps).logits
        finally:
            wm.record_masks = False
        # per kind: kept groups summed over the first t+1 tokens, float64 [L, B, T] on the CPU (one copy
        # per batch), so that a row's real-token count is one lookup at its length - 1
        pending = {}
        for kind in ("attn", "ffn"):
            layers = [wm.record.masks[(kind, i)] for i in range(wm.dims.num_layers) if (kind, i) in wm.record.masks]
            if layers:
                pending[kind] = torch.stack([m.sum(-1, dtype=torch.float64) for m in layers]).cumsum(-1).cpu()
        wm.record = RoutingRecord()
        self._pending = pending
        self._row = 0
        return logits

    def _select_cont_toks(self, logits: torch.Tensor, contlen: int | None = None,
                          inplen: int | None = None) -> torch.Tensor:
        """``HFLM``'s continuation slice; also counts row ``k``'s first ``inplen`` (real) tokens' routing.

        ``HFLM`` calls this once per row of the last :meth:`_model_call`, in row order, with the row's
        unpadded length ``inplen``.
        """
        if self._pending is not None and inplen is not None:
            n = int(inplen)
            for kind, kept in self._pending.items():
                n_groups = self.wide_model.n_attn_groups if kind == "attn" else self.wide_model.n_ffn_groups
                k = self._meter.kept.setdefault(kind, [0.0] * self.wide_model.dims.num_layers)
                t = self._meter.total.setdefault(kind, [0.0] * self.wide_model.dims.num_layers)
                row = kept[:, self._row, n - 1].tolist()
                for i, v in enumerate(row):
                    k[i] += v
                    t[i] += n * n_groups
            self._tokens += n
            self._rows += 1
            self._row += 1
        return super()._select_cont_toks(logits, contlen=contlen, inplen=inplen)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """Generation through the routed base model (argmax routing); not counted in the sparsity."""
        if self.wide_model is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        wm = self.wide_model
        wm.stochastic = False
        wm.record, wm._cur = RoutingRecord(), {}
        try:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        finally:
            wm.record, wm._cur = RoutingRecord(), {}

    def get_model_info(self) -> dict:
        """``HFLM``'s model facts plus the WIDE checkpoint, its config and the realized sparsity summary."""
        info = super().get_model_info()
        if self.wide_model is not None:
            rep = self.sparsity_report() or {}
            info.update({"wide_checkpoint": self.wide_path, "wide_config": self.wide_model.config.to_dict(),
                         **{k: rep[k] for k in ("attn_sparsity", "ffn_sparsity", "realized_sparsity",
                                                "flop_weighted_sparsity", "tokens") if k in rep}})
        return info


_register()


# --- running ---------------------------------------------------------------------------------------
def resolve_tasks(spec: str | list[str]) -> list[str]:
    """Expand a comma-separated task list: ``all`` (the seven zero-shot tasks and WikiText-2),
    ``zeroshot``/``wide_zeroshot`` (the seven), ``wikitext``; short names (``arc_easy``) get the
    ``wide_`` prefix.

    Args:
        spec: ``"arc_easy,piqa"`` or a list of names; short and ``wide_`` names are both accepted.

    Returns:
        the full task names (``wide_...``), each once, in the order given.

    Raises:
        WideError: no task, or an unknown task name; the message lists the known ones (short names).
    """
    names = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec) if t.strip()]
    short = ", ".join(t.removeprefix("wide_") for t in ALL_TASKS)
    known = f"all, zeroshot, {short} (each also with the prefix wide_, e.g. wide_arc_easy)"
    if not names:
        raise WideError(f"no task given; known: {known}")
    out: list[str] = []
    for n in names:
        if n == "all":
            out += ALL_TASKS
        elif n in ("zeroshot", "wide_zeroshot"):
            out += ZEROSHOT_TASKS
        else:
            full = n if n.startswith("wide_") else f"wide_{n}"
            if full not in ALL_TASKS:
                raise WideError(f"unknown task {n!r}; known: {known}")
            out.append(full)
    return list(dict.fromkeys(out))


def task_manager(metadata: dict | None = None):
    """An lm-eval ``TaskManager`` over this package's task YAMLs alone (:data:`wide.eval.tasks.TASKS_DIR`; each is
    self-contained). lm-eval's own task index is left out (``include_defaults=False``): indexing its thousands
    of YAMLs took ~10 s per call, and :func:`evaluate` runs only our tasks (``wide lm-eval`` keeps lm-eval's)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata or {})


def summarize(results: dict) -> dict:
    """Flatten ``lm_eval.simple_evaluate`` results into the record fields of ``benchmarks/quality``.

    Returns:
        ``{arc_easy, ..., hellaswag}`` (accuracy in [0, 1] with the paper's metric per task, only for
        tasks present), ``avg_acc`` (mean of those, present when all seven are), ``*_n`` (documents
        evaluated), ``*_stderr`` (lm-eval's, or with ``bootstrap_iters=0`` the same closed form
        ``sqrt(p (1 - p) / (n - 1))`` of a 0/1 metric's mean), and ``wikitext_word_ppl`` / ``wikitext_byte_ppl`` / ``wikitext_bits_per_byte``
        when WikiText-2 ran.
    """
    res = results.get("results", {})
    out: dict = {}
    for task, (key, metric) in PAPER_METRIC.items():
        if task in res and f"{metric},none" in res[task]:
            out[key] = float(res[task][f"{metric},none"])
            se = res[task].get(f"{metric}_stderr,none")
            n = res[task].get("sample_len") or results.get("n-samples", {}).get(task, {}).get("effective")
            if n:
                out[f"{key}_n"] = int(n)
            if isinstance(se, (int, float)) and not math.isnan(se):
                out[f"{key}_stderr"] = float(se)
            elif n and n > 1:  # bootstrap_iters=0: the closed form lm-eval's mean_stderr gives for a 0/1 metric
                p = out[key]
                out[f"{key}_stderr"] = math.sqrt(p * (1.0 - p) / (n - 1))
    keys = [k for k, _ in PAPER_METRIC.values()]
    if all(k in out for k in keys):
        out["avg_acc"] = sum(out[k] for k in keys) / len(keys)
    if WIKITEXT_TASK in res:
        w = res[WIKITEXT_TASK]
        out["wikitext_word_ppl"] = float(w["word_perplexity,none"])
        out["wikitext_byte_ppl"] = float(w["byte_perplexity,none"])
        out["wikitext_bits_per_byte"] = float(w["bits_per_byte,none"])
    return out


def evaluate(lm: WideLM, tasks: str | list[str], limit: int | float | None = None,
             wikitext_path: str | None = None, bootstrap_iters: int = 100000, log_samples: bool = False) -> dict:
    """Run lm-eval (zero-shot) on ``lm`` over our offline tasks.

    Args:
        lm: a :class:`WideLM`.
        tasks: see :func:`resolve_tasks`.
        limit: at most this many documents per task (an int), or a fraction; ``None`` = all (the paper).
        wikitext_path: ``wiki.test.raw`` for ``wide_wikitext`` (default: see
            :func:`wide.eval.tasks.loaders.wikitext_path`).
        bootstrap_iters: lm-eval's stderr bootstrap iterations (0 = none).
        log_samples: keep lm-eval's per-sample records in the result.

    Returns:
        ``{"summary": summarize(...), "sparsity": lm.sparsity_report(), "results": <lm-eval results>}``.

    Raises:
        WideError: unknown tasks, a bad ``limit``, missing task data.
    """
    import lm_eval

    names = resolve_tasks(tasks)
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise WideError(f"limit {limit!r} must be a positive number of documents (or a fraction)")
    meta = {"wikitext_path": wikitext_path} if wikitext_path else {}
    lm.reset_sparsity()
    results = lm_eval.simple_evaluate(model=lm, tasks=names, num_fewshot=0, limit=limit,
                                      task_manager=task_manager(meta), bootstrap_iters=bootstrap_iters,
                                      log_samples=log_samples, random_seed=0, numpy_random_seed=1234,
                                      torch_random_seed=1234, fewshot_random_seed=1234)
    return {"summary": summarize(results), "sparsity": lm.sparsity_report(), "results": results}


def lm_eval_main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with ``wide`` registered and our tasks on ``--include_path``.

    ``argv`` are lm-eval's own arguments (``run`` is implied as with ``lm_eval``), e.g.
    ``--model wide --model_args pretrained=smollm2-135m,wide=runs/s50 --tasks wide_zeroshot``.
    lm-eval's output (stdout, logging) passes through unchanged.

    Returns:
        0 on success; 2 when lm-eval raised an exception (e.g. ``ValueError: Tasks not found: x``), after
        printing it as one line ``wide lm-eval: error: <message>`` on stderr, without a traceback.
        lm-eval's own ``SystemExit`` (``--help``, its argparse errors) and ``KeyboardInterrupt`` propagate.
    """
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    cmd = args[0] if args and args[0] in ("run", "ls", "validate") else None
    if cmd in ("run", "ls", "validate", None) and "--include_path" not in args:
        args += ["--include_path", str(TASKS_DIR)]
    old = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except Exception as e:  # noqa: BLE001 - any failure inside lm-eval is reported as one line
        print(f"wide lm-eval: error: {_one_line(e)}", file=sys.stderr)
        return 2
    finally:
        sys.argv = old
    return 0


def _one_line(e: BaseException) -> str:
    """``e`` as one line: its message's first non-empty line, with the type name unless a ValueError."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if isinstance(e, ValueError) and msg:
        return msg
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


if __name__ == "__main__":
    raise SystemExit(lm_eval_main())
