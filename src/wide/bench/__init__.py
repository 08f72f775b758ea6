"""Benchmarks (``wide bench ...``); each module exposes ``add_arguments(parser)`` and ``run(args)``."""
