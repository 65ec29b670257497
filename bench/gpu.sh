#!/usr/bin/env bash
# GPU throughput table (issue 6): ResNet-50, 224 px, batch 256 per GPU; fp32 / 16-mixed / bf16-mixed, each with and
# without channels_last, and torch.compile; synthetic data, then the real input pipeline on generated JPEGs.
#   bash bench/gpu.sh                  # one GPU (not yet run on one): table in runs/bench/gpu.md, rows in gpu.json
#   bash bench/gpu.sh --tiny           # CPU smoke run of the same path, ~1 min (tests/test_bench.py runs it)
#   bash bench/gpu.sh --variants bf16-mixed+cl --steps 200     # extra arguments go to bench/gpu_bench.py
# Environment: BENCH_OUT (default runs/bench), BENCH_JPEGS (default $BENCH_OUT/fake_imagenet, generated once).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${BENCH_OUT:-runs/bench}
jpegs=${BENCH_JPEGS:-$out/fake_imagenet}
tiny=0
for arg in "$@"; do [ "$arg" = "--tiny" ] && tiny=1; done

if [ "$tiny" = 1 ]; then
    # 2 classes of small JPEGs: enough for a few batches of 8 through the real pipeline.
    python bench/fake_imagenet.py "$jpegs" --classes 2 --train 48 --val 2 --size 64x48 --workers 1
    python bench/gpu_bench.py --jpegs "$jpegs" --out "$out/gpu_tiny" "$@"
else
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # 150 steps x 256 images: the measured steps of each real row stay within about one pass over the files.
    python bench/fake_imagenet.py "$jpegs" --classes 1000 --train 38400 --val 1000
    python bench/gpu_bench.py --jpegs "$jpegs" --out "$out/gpu" "$@"
fi
