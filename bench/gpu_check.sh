#!/usr/bin/env bash
# Strategy and precision check on one GPU (issue 3): `python -m project fit` with the configs, ResNet-50 on generated
# JPEGs, a few hundred steps each: gpu, dp, ddp (1 device), fp16, bf16, channels_last, compile; then dp over a
# repeated device id (Lightning's --trainer.devices=[0,0], and torch's DataParallel directly).
#   bash bench/gpu_check.sh             # one GPU (not yet run on one); summary in runs/gpu_check/summary.md
#   bash bench/gpu_check.sh --tiny      # CPU, resnet18 32 px, 4 steps: the runs that make sense without a GPU
# Environment: CHECK_OUT (runs/gpu_check), BENCH_JPEGS (generated once), STEPS (200), BATCH (128), WORKERS (cpus - 2).
# A failing run does not stop the others; its exit code goes into the summary.
set -uo pipefail
cd "$(dirname "$0")/.."

out=${CHECK_OUT:-runs/gpu_check}
mkdir -p "$out"
if [ "${1:-}" = "--tiny" ]; then
    jpegs=${BENCH_JPEGS:-$out/fake_imagenet}
    python bench/fake_imagenet.py "$jpegs" --classes 2 --train 48 --val 2 --size 64x48 --workers 1 || exit 1
    base=(--config configs/quickstart.yaml --data.root="$jpegs" --trainer.max_steps="${STEPS:-4}" --data.batch_size=8
          --trainer.log_every_n_steps=1 --trainer.limit_val_batches=1 --trainer.enable_progress_bar=false
          --trainer.enable_model_summary=false)
    runs=(cpu dp ddp channels_last)
    skip=1
else
    jpegs=${BENCH_JPEGS:-runs/bench/fake_imagenet}
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python bench/fake_imagenet.py "$jpegs" --classes 1000 --train 38400 --val 1000 || exit 1
    workers=${WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
    base=(--config configs/gpu.yaml --model.arch=resnet50 --data.root="$jpegs" --data.batch_size="${BATCH:-128}"
          --data.num_workers="$workers" --trainer.max_steps="${STEPS:-200}" --trainer.log_every_n_steps=20
          --trainer.limit_val_batches=2 --trainer.enable_progress_bar=false)
    runs=(gpu dp ddp fp16 bf16 channels_last compile dp_repeat)
    skip=2
fi

args_for() {
    case "$1" in
        gpu|cpu) ;;
        dp) echo --trainer.strategy=dp ;;
        ddp) echo --trainer.strategy=ddp --trainer.devices=1 ;;
        fp16) echo --config configs/fp16.yaml ;;
        bf16) echo --config configs/bf16.yaml ;;
        channels_last) [ "$skip" = 2 ] && echo --config configs/bf16.yaml; echo --model.channels_last=true ;;
        compile) echo --config configs/bf16.yaml --model.channels_last=true --model.compile=true ;;
        dp_repeat) echo --trainer.strategy=dp "--trainer.devices=[0,0]" ;;
    esac
}

status=()
for run in "${runs[@]}"; do
    rm -rf "${out:?}/$run"
    # shellcheck disable=SC2046  # the extra arguments are single words
    python -m project fit "${base[@]}" $(args_for "$run") --trainer.default_root_dir="$out/$run" > "$out/$run.log" 2>&1
    code=$?
    status+=("$run: exit $code")
    echo "$run: exit $code (log: $out/$run.log)"
    [ "$code" = 0 ] || tail -3 "$out/$run.log"
done

{
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo CPU)"
    echo
    printf '%s\n' "${status[@]/#/- }"
    echo
    python bench/read_perf.py --skip "$skip" $(for run in "${runs[@]}"; do echo "$out/$run"; done)
    if [ "$skip" = 2 ]; then
        echo
        grep -h -m1 -i "unique\|device" "$out/dp_repeat.log" | sed 's/^/Lightning with --trainer.devices=[0,0]: /'
        python bench/dp_repeat_probe.py
    fi
} | tee "$out/summary.md"
