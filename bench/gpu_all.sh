#!/usr/bin/env bash
# Everything this project measures on one GPU, in one run of at most 8 minutes on an H200, as one Markdown table:
# ResNet-50 at 224 px img/s, MFU and peak memory (bf16-mixed + channels_last, + torch.compile, 16-mixed), synthetic
# data against the real pipeline on generated ImageNet-shaped JPEGs with CPU decoding (torchvision, torchcodec) and
# GPU decoding (nvjpeg, torchcodec-cuda) on every core, our Trainer path against a plain PyTorch loop, device
# augmentation per batch, and one short fit through configs/gpu.yaml, dp, ddp (one device), fp16, bf16, fsdp2 (one
# device) and the JPEGs as shards (classifier_engine.data.ShardDataModule).
#   bash bench/gpu_all.sh            # one GPU: runs/gpu_all/table.md; parts (*.json) and logs beside it
#   bash bench/gpu_all.sh --tiny     # the same code on CPU (resnet18, 32 px, 32-true, a few steps; 4 of the 7 fits):
#                                    # tests/test_bench.py
# A GPU machine without network: run `bash bench/fetch_gpu_wheels.sh` where there is one and bring .whl/ along; the
# wheels of what is missing here (jsonargparse, torchcodec) are installed into $GPU_ALL_SITE and put on PYTHONPATH.
# Each stage has a time limit inside the 8 minutes; a stage that fails or runs out leaves its rows saying so.
# Environment: GPU_ALL_OUT (runs/gpu_all), BENCH_JPEGS (default $GPU_ALL_OUT/fake_imagenet, reused when complete).
set -uo pipefail
cd "$(dirname "$0")/.."

tiny=0
[ "${1:-}" = "--tiny" ] && tiny=1
out=${GPU_ALL_OUT:-runs/gpu_all}
jpegs=${BENCH_JPEGS:-$out/fake_imagenet}
mkdir -p "$out/fits"
export PYTHONUNBUFFERED=1
start=$SECONDS
budget=470  # seconds for all stages on the GPU; the table takes a few more
scale=$(( tiny ? 3 : 1 ))  # --tiny checks the code path: a loaded CI machine must not hit the GPU's limits
log() { echo "gpu_all: [$((SECONDS - start)) s] $*"; }
# At most $1 seconds, and never past the budget minus $2 seconds kept for the stages after this one.
limit() {
    local left=$(( scale * budget - (SECONDS - start) - scale * $2 ))
    echo $(( left < scale * $1 ? (left > 5 ? left : 5) : scale * $1 ))
}

# 0. What this machine lacks, from the wheels in .whl/ (bench/fetch_gpu_wheels.sh).
missing=()
for wheel in .whl/*.whl; do
    [ -e "$wheel" ] || continue
    module=$(basename "$wheel"); module=${module%%-*}
    python3 -c "import $module" 2>/dev/null || missing+=("$wheel")
done
if [ ${#missing[@]} -gt 0 ]; then
    site=${GPU_ALL_SITE:-/tmp/gpu_all_site}
    log "installing ${missing[*]} into $site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${missing[@]}" || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -c "import jsonargparse" 2>/dev/null; then
    echo "gpu_all: jsonargparse is missing and .whl/ holds no wheel of it: run bash bench/fetch_gpu_wheels.sh on a" \
         "machine with network and bring .whl/ here (or pip install -e .)" >&2
    exit 1
fi
python3 - > "$out/meta.json" <<'EOF'
import json, os, platform, torch
from importlib.metadata import version  # lightning's and torchvision's without their ~4 s of imports
try:
    import torchcodec; codec = torchcodec.__version__
except Exception as error:  # an optional extra: the torchcodec rows then say why they did not run
    codec = f"not importable ({type(error).__name__})"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(json.dumps({"gpu": gpu, "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                  "torchvision": version("torchvision"), "lightning": version("lightning"), "torchcodec": codec}))
EOF
log "$(cat "$out/meta.json")"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. JPEGs shaped like ImageNet's (its usual shapes, ~100 KB): one epoch holds warm-up + measured steps of batch 256.
gen_start=$SECONDS
if [ "$tiny" = 1 ]; then
    python3 bench/fake_imagenet.py "$jpegs" --classes 2 --train 48 --val 8 --size 64x48 --workers 1 || exit 1
else
    python3 bench/fake_imagenet.py "$jpegs" --classes 1000 --train 20480 --val 1000 --size mixed --workers "$(nproc)" \
        || exit 1
fi
echo "{\"jpeg_seconds\": $((SECONDS - gen_start))}" > "$out/jpegs.json"
log "JPEGs ready in $((SECONDS - gen_start)) s"

# 2. Throughput: synthetic rows, then the real pipeline with each decoder (bf16-mixed + channels_last); compile alone
# after them, so a slow compilation cannot cost the other rows.
if [ "$tiny" = 1 ]; then
    steps=(--tiny --batch-size 8 --warmup 1 --steps 2 --window 1)
else
    steps=(--warmup 20 --steps 60 --window 10 --workers "$(nproc)")
fi
log "throughput rows"
timeout "$(limit 180 250)" python3 bench/gpu_bench.py --jpegs "$jpegs" --variants bf16-mixed+cl,16-mixed+cl \
    --real bf16-mixed+cl --decoders torchvision,torchcodec,nvjpeg,torchcodec-cuda "${steps[@]}" \
    --out "$out/throughput" > "$out/throughput.log" 2>&1
log "throughput: exit $? (log: $out/throughput.log)"
timeout "$(limit 120 150)" python3 bench/gpu_bench.py --jpegs "$jpegs" --variants bf16-mixed+cl+compile --real none \
    "${steps[@]}" --out "$out/compile" > "$out/compile.log" 2>&1
log "compile: exit $? (log: $out/compile.log)"

# 3. Our Trainer path against a plain PyTorch loop, alternating on the same device.
if [ "$tiny" = 1 ]; then
    overhead=(--quick --block 2)
else
    overhead=(--accelerator gpu --precision bf16-mixed --channels-last --arch resnet50 --image-size 224
              --batch-size 256 --num-classes 1000 --steps 40 --rounds 2 --block 10 --tolerance 0.05)
fi
log "Trainer / plain loop"
timeout "$(limit 60 90)" python3 bench/overhead.py "${overhead[@]}" --json "$out/overhead.json" > "$out/overhead.log" 2>&1
log "overhead: exit $? (log: $out/overhead.log)"

# 4. Device augmentation, one batch: image by image against batch-wise.
if [ "$tiny" = 1 ]; then augment=(--device cpu --batch 16 --crop 32 --resize 36 --rounds 2); else augment=(--rounds 5); fi
timeout "$(limit 30 60)" python3 bench/device_augment.py --jpegs "$jpegs" "${augment[@]}" --json "$out/augment.json" \
    > "$out/augment.log" 2>&1
log "device augmentation: exit $? (log: $out/augment.log)"

# 5. One short fit through each config, as a user starts it.
if [ "$tiny" = 1 ]; then
    base=(--config configs/quickstart.yaml --data.root="$jpegs" --trainer.max_steps=2 --data.batch_size=8
          --trainer.log_every_n_steps=1 --trainer.limit_val_batches=1)
else
    base=(--config configs/gpu.yaml --model.arch=resnet50 --data.root="$jpegs" --data.batch_size=128
          --data.num_workers="$(nproc)" --trainer.max_steps=30 --trainer.log_every_n_steps=10
          --trainer.limit_val_batches=2)
fi
# The same JPEGs as shards (tools/make_shards.py: short side <= 256, re-encoded; a rerun keeps finished shards), for
# the shards fit beside the folder's (fit: gpu).
log "shards of the JPEGs"
timeout "$(limit 60 120)" python3 -m tools.make_shards --source "$jpegs" --out "$out/shards" > "$out/shards.log" 2>&1
log "shards: exit $? (log: $out/shards.log)"
fits=(gpu "" dp "--trainer.strategy=dp" ddp "--trainer.strategy=ddp --trainer.devices=1"
      fp16 "--config configs/fp16.yaml" bf16 "--config configs/bf16.yaml"
      fsdp "--config configs/fsdp.yaml --trainer.devices=1"
      shards "--data.class_path=classifier_engine.data.ShardDataModule --data.init_args.shards=$out/shards")
fit() {  # name, seconds, extra arguments: one fit, its exit code in fits/<name>.code
    local name=$1 seconds=$2
    rm -rf "${out:?}/fits/$name"
    # shellcheck disable=SC2086  # the extra arguments are single words
    timeout "$seconds" python3 -m project fit "${base[@]}" $3 --trainer.enable_progress_bar=false \
        --trainer.enable_model_summary=false --trainer.default_root_dir="$out/fits/$name" > "$out/fits/$name.log" 2>&1
    echo $? > "$out/fits/$name.code"
}
# --tiny leaves out the fits whose command lines tests/test_strategies.py parses and builds (dp, ddp, 16-mixed): the
# rest, two at a time (each is mostly imports on one core); one GPU: one by one.
tiny_skips=" dp ddp fp16 "
started=0
for ((i = 0; i < ${#fits[@]}; i += 2)); do
    if [ "$tiny" = 0 ]; then
        fit "${fits[i]}" "$(limit 45 $(( (${#fits[@]} - i - 2) * 6 )))" "${fits[i + 1]}"
    elif [[ $tiny_skips == *" ${fits[i]} "* ]]; then
        echo skipped > "$out/fits/${fits[i]}.code"
    else
        fit "${fits[i]}" "$(limit 90 0)" "${fits[i + 1]}" &
        (( ++started % 2 == 0 )) && wait
    fi
done
wait
: > "$out/fits.tsv"
for ((i = 0; i < ${#fits[@]}; i += 2)); do
    name=${fits[i]} code=$(cat "$out/fits/${fits[i]}.code") && rm "$out/fits/${fits[i]}.code"
    printf '%s\t%s\t%s\n' "$name" "$code" "${base[1]} ${fits[i + 1]}" >> "$out/fits.tsv"
    log "fit $name: exit $code (log: $out/fits/$name.log)"
done

# 6. The table.
python3 bench/gpu_table.py "$out" $([ "$tiny" = 1 ] && echo --tiny) | tee "$out/table.md"
log "done: $out/table.md"
