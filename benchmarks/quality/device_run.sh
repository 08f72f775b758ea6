#!/usr/bin/env bash
# One GPU call of the quality suite (issue 4), after the bundled GGUF was joined into /tmp/wide-model and the
# wheels / task data were unpacked (QUALITY_SUITE.md, "GPU commands"). Usage on the device machine:
#   bash benchmarks/quality/device_run.sh [run_parallel.py options...]
# Runs table + uniform + sparsity + group plans as parallel jobs over every GPU (run_parallel.py), resuming
# from the records committed in benchmarks/quality/, and leaves quality.tgz / routers.tar / run.log in $OUT.
set -uo pipefail
export WIDE_TASK_DATA=/tmp/td PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 benchmarks/quality/run_parallel.py --plans table uniform sparsity group --resume-dir benchmarks/quality \
  --out "$OUT" "$@" -- \
  --model /tmp/wide-model/SmolLM2-135M-Instruct.Q4_1.gguf --calib .device/data/calibration/wiki_owt.jsonl \
  --wikitext .device/data/wikitext-2-raw/wiki.test.raw --steps 300 --lora-steps 200 --limit 1000 \
  --bootstrap-iters 0 --eval-batch-size 64 --runs /tmp/runs 2>&1 | tee "$OUT/run.log"
