"""``wide bench``: registers the benchmarks as subcommands (``wide bench kernels``, ``wide bench e2e``).

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only
when their subcommand runs, so ``wide --help`` stays light.
"""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "kernels": ("wide.bench.kernels", "routed kernels against cuBLAS / SDPA flash on one GPU (benchmarks/kernels/)"),
    "e2e": ("wide.bench.e2e", "end-to-end TTFT / TPOT of the inference engine vs dense (benchmarks/e2e/)"),
}


def _runner(name: str, module: str):
    def run(args) -> int:
        """Run ``wide bench <name>``.

        Raises:
            WideError: no CUDA GPU (unless ``--report-only``); both benchmarks time GPU code. The CLI prints it
                as ``wide bench: error: ...`` with exit code 2, the same for every benchmark.
        """
        if not getattr(args, "report_only", False):
            import torch

            from wide.errors import WideError

            if not torch.cuda.is_available():
                raise WideError(f"wide bench {name} times GPU code and needs a CUDA GPU; none is available "
                                f"(--report-only rebuilds the table and plot from an earlier run's JSON)")
        return importlib.import_module(module).run(args)
    return run


def register(sub) -> None:
    """Add ``bench <name>`` to the ``wide`` subcommands (``sub`` from ``ArgumentParser.add_subparsers``)."""
    b = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    bsub = b.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHMARKS) + "}",
                            title="benchmark (one of)")
    for name, (module, help_) in BENCHMARKS.items():
        s = bsub.add_parser(name, help=help_)
        importlib.import_module(module).add_arguments(s)
        s.set_defaults(func=_runner(name, module))
