#!/bin/bash
# One prepared device session: Triton kernels on CUDA, drafter latency and the trace-replay load sweep
# on a random-init Qwen3-4B-shaped target, the verifier micro-benchmark. Everything lands in $OUT.
# entry points of the built-in plugins without installing (nothing can be fetched there);
# .gpu/ held copies of docs/results/calibration/dspark-traces.jsonl and the shipped dspark calibration.json
EP_ROOT=$(mktemp -d); EP=$EP_ROOT/dspec-0.0.0.dist-info; mkdir -p $EP
printf 'Metadata-Version: 2.1\nName: dspec\nVersion: 0.0.0+device\n' > $EP/METADATA
{ echo '[dspec]'; sed -n '/^\[project.entry-points.dspec\]/,/^$/p' pyproject.toml | grep ' = ' | tr -d '"'; } > $EP/entry_points.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/plugins:$EP_ROOT
LOG=$OUT/log.txt
step() { echo "=== $1 $(date +%T)" | tee -a $LOG; }
step env
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"
  nproc; } >> $LOG 2>&1
step triton-tests
DSPEC_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_verify_triton.py >> $LOG 2>&1; echo "rc=$?" >> $LOG
step trace-load
timeout 300 python3 -m dspec_cli.benchmarks.trace_load --traces .gpu/dspark-traces.jsonl --calibration .gpu/calibration.json \
  --shape qwen3-4b --device cuda --concurrency 1,4,16,64,256 --repeats 2 --prompts-per-slot 1 --max-new-tokens 48 \
  --cost-table-out $OUT/cost-table-gpu.json --json $OUT/bench-load-gpu.json --plots $OUT >> $LOG 2>&1; echo "rc=$?" >> $LOG
step drafter-latency
timeout 100 python3 -m dspec_cli.benchmarks.drafter_latency --shape qwen3-4b --device cuda --blocks 4,7,8,16 \
  --repeats 30 --json $OUT/drafter-latency-gpu.json >> $LOG 2>&1; echo "rc=$?" >> $LOG
step verify-bench
timeout 75 python3 -m dspec_cli.benchmarks.verify --device cuda --max-gib 6 --json $OUT/verify-gpu.json >> $LOG 2>&1; echo "rc=$?" >> $LOG
step done
