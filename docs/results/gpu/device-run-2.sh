#!/bin/bash
# Second device session: drafter latency with a longer warm-up (run twice, blocks in opposite orders),
# and a replication of the trace-replay sweep with the first session's cost table.
EP_ROOT=$(mktemp -d); EP=$EP_ROOT/dspec-0.0.0.dist-info; mkdir -p $EP
printf 'Metadata-Version: 2.1\nName: dspec\nVersion: 0.0.0+device\n' > $EP/METADATA
{ echo '[dspec]'; sed -n '/^\[project.entry-points.dspec\]/,/^$/p' pyproject.toml | grep ' = ' | tr -d '"'; } > $EP/entry_points.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/plugins:$EP_ROOT
LOG=$OUT/log2.txt
step() { echo "=== $1 $(date +%T)" | tee -a $LOG; }
step drafter-latency
timeout 110 python3 -m dspec_cli.benchmarks.drafter_latency --shape qwen3-4b --device cuda --blocks 16,8,7,4,4,7,8,16 \
  --warmup 20 --repeats 30 --json $OUT/drafter-latency-gpu-2.json >> $LOG 2>&1; echo "rc=$?" >> $LOG
step trace-load
timeout 160 python3 -m dspec_cli.benchmarks.trace_load --traces .gpu/dspark-traces.jsonl --calibration .gpu/calibration.json \
  --shape qwen3-4b --device cuda --concurrency 1,16,256 --repeats 2 --prompts-per-slot 1 --max-new-tokens 48 \
  --cost-table .gpu/cost-table-gpu.json --json $OUT/bench-load-gpu-2.json >> $LOG 2>&1; echo "rc=$?" >> $LOG
step done
