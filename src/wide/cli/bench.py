"""``wide bench kernels`` and ``wide bench e2e``: each benchmark module has ``add_arguments(parser)`` and
``run(args) -> int`` and is imported when its subcommand is parsed."""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "kernels": ("wide.bench.kernels", "routed kernels against cuBLAS / SDPA flash on one GPU (benchmarks/kernels/)"),
    "e2e": ("wide.bench.e2e", "end-to-end TTFT / TPOT of the inference engine vs dense (benchmarks/e2e/)"),
}


def _runner(name: str, module: str):
    def run(args) -> int:
        """Run ``wide bench <name>``; raises WideError without a CUDA GPU (unless ``--report-only``)."""
        from wide.cli.common import check_writable
        from wide.errors import WideError

        check_writable("--out-dir", args.out_dir, folder="for the results (it is created if missing)")
        if not args.report_only:
            import torch

            if not torch.cuda.is_available():
                raise WideError("this benchmark times GPU code and needs a CUDA GPU; none is available "
                                "(--report-only rebuilds the table and plot from an earlier run's JSON)")
        return importlib.import_module(module).run(args)
    return run


def register(sub) -> None:
    """Add ``bench <name>`` to the ``wide`` subcommands."""
    b = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    bsub = b.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHMARKS) + "}",
                            title="benchmark (one of)")
    for name, (module, help_) in BENCHMARKS.items():
        s = bsub.add_parser(name, help=help_)
        importlib.import_module(module).add_arguments(s)
        s.set_defaults(func=_runner(name, module))
