#!/usr/bin/env bash
# Everything this project measures on one GPU, in one run of at most 8 minutes on an H200, as one Markdown table:
# the GPU tests (pytest -m gpu), ResNet-50 at 224 px img/s, MFU and peak memory (bf16-mixed + channels_last, 16-mixed,
# + torch.compile), a short fit through each strategy and config at bf16-mixed + channels_last on GPU-decoded JPEGs
# (fsdp2 with and without a unit per BatchNorm, ViT-L/16's config on sharded checkpoints, ddp with and without
# gradient_as_bucket_view, dp, one device, 16-mixed), synthetic data against the real pipeline on generated
# ImageNet-shaped JPEGs with GPU decoding (nvjpeg, torchcodec-cuda) and CPU decoding (torchvision, torchcodec) on every
# core, our Trainer path against a plain PyTorch loop, device augmentation per batch, and the JPEGs as shards.
#   bash bench/gpu_all.sh            # one GPU: runs/gpu_all/table.md; parts (*.json) and logs beside it
#   bash bench/gpu_all.sh --tiny     # the same code on CPU (resnet18, 32 px, 32-true, a few steps; 6 of the 9 fits):
#                                    # tests/test_bench.py
# A GPU machine without network: run `bash bench/fetch_gpu_wheels.sh` where there is one and bring .whl/ along; the
# wheels of what is missing here (jsonargparse, torchcodec) are installed into $GPU_ALL_SITE and put on PYTHONPATH.
# Every stage runs under a hard limit (TERM, then KILL 5 s later) inside the budget, and after every stage the table so
# far is printed and, when $OUT is set (the device tool's folder), the parts, logs and table are saved there
# (gpu_all.tgz, table.md; never the JPEGs, shards or checkpoints): a run cut at any point brings back what it measured.
# Environment: GPU_ALL_OUT (runs/gpu_all), BENCH_JPEGS (default $GPU_ALL_OUT/fake_imagenet, reused when complete),
# GPU_ALL_BUDGET (470: seconds for all stages), GPU_ALL_LIMITS ("name=seconds ..." overrides a stage's limit),
# GPU_ALL_HANG_STAGE (a stage that hangs instead, ignoring TERM: tests/test_bench.py checks the hard limits).
set -uo pipefail
cd "$(dirname "$0")/.."

# The folders whose packages the stages import, on PYTHONPATH (from here, so python -m and pytest find them too).
roots=(. engine)  # the template and its engine (classifier_engine)
export PYTHONPATH
PYTHONPATH=$(IFS=:; echo "${roots[*]/#/$PWD/}")${PYTHONPATH:+:$PYTHONPATH}

tiny=0
[ "${1:-}" = "--tiny" ] && tiny=1
out=${GPU_ALL_OUT:-runs/gpu_all}
jpegs=${BENCH_JPEGS:-$out/fake_imagenet}
save_to=${OUT:-}
hang=${GPU_ALL_HANG_STAGE:-}
declare -A limits=()
for pair in ${GPU_ALL_LIMITS:-}; do limits[${pair%%=*}]=${pair#*=}; done
mkdir -p "$out/fits"
rm -f "$out"/*.json "$out"/*.xml "$out"/*.tsv "$out"/*.md "$out/gpu_all.log"  # a rerun's table is its own
export PYTHONUNBUFFERED=1
start=$SECONDS
budget=${GPU_ALL_BUDGET:-470}  # seconds for all stages on the GPU; the table takes a few more
scale=$(( tiny ? 3 : 1 ))  # --tiny checks the code path: a loaded CI machine must not hit the GPU's limits
deadline=$(( start + scale * budget ))
log() { echo "gpu_all: [$((SECONDS - start)) s] $*" | tee -a "$out/gpu_all.log"; }

# What has been measured so far: the table printed, and into $OUT the parts, logs and table (the device tool brings
# back only $OUT and the output's last 12,000 characters). Written under another name, then renamed: a run killed
# while saving leaves the previous archive whole.
save() {
    timeout -k 2 60 python3 bench/gpu_table.py "$out" $([ "$tiny" = 1 ] && echo --tiny) > "$out/table.md.part" \
        2>> "$out/gpu_all.log" && mv "$out/table.md.part" "$out/table.md"
    cat "$out/table.md" 2>/dev/null
    [ -n "$save_to" ] || return 0
    mkdir -p "$save_to"
    local skip_jpegs
    skip_jpegs=./$(realpath -m --relative-to="$out" "$jpegs")
    (cd "$out" && find . \( -path "$skip_jpegs" -o -path ./shards \) -prune -o -type f -size -2M \
        \( -name '*.json' -o -name '*.log' -o -name '*.md' -o -name '*.tsv' -o -name '*.xml' -o -name '*.yaml' \
        -o -name 'events.out.tfevents.*' \) -print0 | timeout -k 2 60 tar --null -czf "$save_to/gpu_all.tgz.part" -T -) \
        && mv "$save_to/gpu_all.tgz.part" "$save_to/gpu_all.tgz" && cp "$out/table.md" "$save_to/table.md" \
        && log "saved $save_to/gpu_all.tgz ($(du -k "$save_to/gpu_all.tgz" | cut -f1) KB) and table.md"
}

# At most $2 seconds (x3 with --tiny; GPU_ALL_LIMITS may say otherwise for stage $1), never into the last $3 seconds
# (x3) kept for the stages after this one, never past the budget. The seconds kept are less than the later stages'
# limits add up to: when time runs short, the stages at the end (fits) are squeezed, not the GPU tests and decoders.
limit() {
    local most=${limits[$1]:-$(( scale * $2 ))} left=$(( deadline - SECONDS - scale * $3 ))
    (( left < 10 )) && left=10
    (( left > deadline - SECONDS )) && left=$(( deadline - SECONDS ))
    echo $(( most < left ? most : left ))
}

# stage NAME MOST KEEP COMMAND...: COMMAND under its limit (limit NAME MOST KEEP), output in NAME.log, exit code in
# stages.tsv (124: TERM at the limit; 137: KILL 5 s later, as a process stuck in a CUDA call needs), then save; not
# run once the budget is spent. NOSAVE=1: the caller saves (stages run side by side).
stage() {
    local name=$1 seconds code t0=$SECONDS
    seconds=$(limit "$1" "$2" "$3")
    shift 3
    if (( deadline - SECONDS < 10 )); then
        code=budget
        log "$name: not run, the budget is spent"
    else
        [ "$name" = "$hang" ] && set -- bash -c 'trap "" TERM; sleep 3600'
        log "$name: limit $seconds s"
        timeout -k 5 "$seconds" "$@" > "$out/$name.log" 2>&1
        code=$?
        log "$name: exit $code$( [[ $code == 124 || $code == 137 ]] && echo ", cut at $seconds s") (log: $out/$name.log)"
    fi
    printf '%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - t0))" >> "$out/stages.tsv"
    [ "${NOSAVE:-0}" = 1 ] || save
    [ "$code" = 0 ]
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
    timeout -k 5 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${missing[@]}" || log "pip install: exit $? (the stages that need these will say so)"
    export PYTHONPATH="$site:$PYTHONPATH"
fi
if ! python3 -c "import jsonargparse" 2>/dev/null; then
    log "jsonargparse is missing and .whl/ holds no wheel of it: run bash bench/fetch_gpu_wheels.sh on a machine" \
        "with network and bring .whl/ here (or pip install -e .)"
    save
    exit 1
fi
stage meta 60 380 python3 -c '
import json, os, platform, sys, torch
from importlib.metadata import version  # lightning and torchvision without their ~4 s of imports
try:
    import torchcodec; codec = torchcodec.__version__
except Exception as error:  # an optional extra: the torchcodec rows then say why they did not run
    codec = f"not importable ({type(error).__name__})"
cuda = torch.cuda.is_available()
meta = {"gpu": torch.cuda.get_device_name() if cuda else "no GPU", "cpus": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__, "torchvision": version("torchvision"),
        "lightning": version("lightning"), "torchcodec": codec,
        # fp32 convolutions run in TF32 on Ampere and newer unless turned off (torch default): the 32-true rows
        "tf32": cuda and torch.cuda.get_device_capability()[0] >= 8 and torch.backends.cudnn.allow_tf32}
open(sys.argv[1], "w").write(json.dumps(meta) + "\n")
print(json.dumps(meta))
' "$out/meta.json"
command -v nvidia-smi >/dev/null && timeout -k 2 20 nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader | tee -a "$out/gpu_all.log"

# 1. The GPU tests first: the device decoders against the training stream's memory, GPU batches against CPU ones,
# the prefetching loader's side stream.
# The repository's addopts name pytest-xdist options, which that machine's pytest may not know.
stage gpu-tests 90 360 python3 -m pytest -o addopts="-ra --strict-markers" -p no:cacheprovider -m gpu \
    engine/tests/test_device_decode.py engine/tests/test_device_prefetch.py --junitxml="$out/gpu-tests.xml"

# 2. JPEGs shaped like ImageNet's (its usual shapes, ~100 KB): one epoch holds warm-up + measured steps of batch 256.
if [ "$tiny" = 1 ]; then
    fake=(--classes 2 --train 48 --val 8 --size 64x48 --workers 1)
else
    fake=(--classes 1000 --train 20480 --val 1000 --size mixed --workers "$(nproc)")
fi
gen_start=$SECONDS
stage jpegs 90 340 python3 bench/fake_imagenet.py "$jpegs" "${fake[@]}" \
    && echo "{\"jpeg_seconds\": $((SECONDS - gen_start))}" > "$out/jpegs.json"

# 3. Throughput, each group of rows in its own process under its own limit (a CUDA error or a hang ends one group):
# synthetic (the baseline of the real rows) first, then the strategy fits (4.), then the real pipeline with each GPU
# decoder, then the CPU decoders, all bf16-mixed + channels_last; compile alone, so a slow compilation costs no other row.
if [ "$tiny" = 1 ]; then
    steps=(--tiny --batch-size 8 --warmup 1 --steps 2 --window 1)
else
    steps=(--warmup 20 --steps 60 --window 10 --workers "$(nproc)")
fi
bench=(python3 bench/gpu_bench.py --jpegs "$jpegs" "${steps[@]}")
real=(--variants bf16-mixed+cl --real bf16-mixed+cl --no-synthetic)
stage synthetic 90 320 "${bench[@]}" --variants bf16-mixed+cl,16-mixed+cl --real none --out "$out/synthetic"

# 4. One short fit through each strategy and config, as a user starts it, at bf16-mixed + channels_last on GPU-decoded
# JPEGs (data.decoder=nvjpeg: the prefetching loader's side stream), fsdp first: FSDP2 with each BatchNorm its own
# unit and grouped with its block, ViT-L/16's config on sharded checkpoints (one GPU, batch 32, 10 steps:
# TrivialAugment and random erasing on the device), ddp with gradient_as_bucket_view, one device; at the end (8.),
# where the budget squeezes first, the shards, ddp as the CLI builds it, dp and 16-mixed. --tiny: the quickstart on
# CPU, 2 steps (the decoder's CPU stand-in).
if [ "$tiny" = 1 ]; then
    base=(--config configs/quickstart.yaml --trainer.max_steps=2 --data.batch_size=8 --data.decoder=nvjpeg
          --trainer.log_every_n_steps=1 --trainer.limit_val_batches=1)
else
    base=(--config configs/gpu.yaml --config configs/bf16.yaml --model.channels_last=true --model.arch=resnet50
          --data.batch_size=128 --data.decoder=nvjpeg --data.num_workers="$(nproc)" --trainer.max_steps=30
          --trainer.log_every_n_steps=10 --trainer.limit_val_batches=2)
fi
fsdp_class=--trainer.strategy=classifier_engine.strategies.fsdp.FSDPStrategy
ddp_class=--trainer.strategy=lightning.pytorch.strategies.DDPStrategy
fits=(fsdp "--config configs/fsdp.yaml --trainer.devices=1"
      fsdp-bn-in-blocks "--config configs/fsdp.yaml --trainer.devices=1 $fsdp_class --trainer.strategy.batchnorm_units=false"
      vit-sharded "--config configs/vit_l16_fsdp_8gpu.yaml --trainer.devices=1 --data.batch_size=32 --trainer.max_steps=10"
      ddp "--trainer.strategy=ddp --trainer.devices=1"
      ddp-bucket-view "$ddp_class --trainer.strategy.gradient_as_bucket_view=true --trainer.devices=1"
      dp "--trainer.strategy=dp" gpu "" fp16 "--config configs/fp16.yaml"
      shards "--data.class_path=classifier_engine.data.ShardDataModule --data.init_args.shards=$out/shards
              --data.init_args.decoder=auto")
# --tiny: bf16-mixed where it is the point (FSDP2's BatchNorm units), ViT-B/32 at 32 px and 32-true on the CPU
declare -A tiny_extra=([fsdp]=--trainer.precision=bf16-mixed [fsdp-bn-in-blocks]=--trainer.precision=bf16-mixed
    [vit-sharded]="--trainer.accelerator=cpu --trainer.precision=32-true --model.arch=vit_b_32 --data.batch_size=8
                   --data.num_workers=0 --data.eval_resize_size=32 --data.eval_crop_size=32 --trainer.max_steps=2")
# --tiny leaves out the fits the engine's tests run on CPU (dp, fp16: test_strategies.py; ddp: test_distributed.py)
tiny_skips=" dp ddp fp16 "
fits_tsv() {  # fits.tsv, in the order above: the fits with an exit code so far (skipped: not with --tiny)
    local i code
    : > "$out/fits.tsv.part"
    for ((i = 0; i < ${#fits[@]}; i += 2)); do
        code=$(awk -F '\t' -v name="fits/${fits[i]}" '$1 == name {code = $2} END {print code}' "$out/stages.tsv")
        [ "$tiny" = 1 ] && [[ $tiny_skips == *" ${fits[i]} "* ]] && code=skipped
        # shellcheck disable=SC2086  # one line of single words
        [ -z "$code" ] || printf '%s\t%s\t%s\n' "${fits[i]}" "$code" "$(echo ${base[1]} ${fits[i + 1]})" \
            >> "$out/fits.tsv.part"
    done
    mv "$out/fits.tsv.part" "$out/fits.tsv"
}
fit() {  # name, seconds kept for the stages after it, extra arguments: one fit
    local name=$1 source="--data.root=$jpegs" extra=$3 most=45
    [ "$name" = shards ] && source=""  # a flag of the folder module before the switch to shards would be refused
    [ "$name" = vit-sharded ] && most=60  # ViT-L/16's build and its sharded checkpoint (~2.4 GB written)
    [ "$tiny" = 1 ] && extra="$extra ${tiny_extra[$name]:-}"
    rm -rf "${out:?}/fits/$name"
    # shellcheck disable=SC2086  # the extra arguments are single words
    NOSAVE=1 stage "fits/$name" "$most" "$2" python3 -m project fit "${base[@]}" $source $extra \
        --trainer.enable_progress_bar=false --trainer.enable_model_summary=false \
        --trainer.default_root_dir="$out/fits/$name"
}
run_fits() {  # the fits named, each keeping 15 s for each one after it and $1 s for the stages after them; one GPU:
    local keep=$1 name i n=0 pending=()  # one by one; --tiny: side by side, two at a time (mostly imports on one core)
    shift
    for name in "$@"; do
        for ((i = 0; i < ${#fits[@]}; i += 2)); do [ "${fits[i]}" = "$name" ] && break; done
        n=$((n + 1))
        if [ "$tiny" = 0 ]; then
            fit "$name" $(( keep + 15 * ($# - n) )) "${fits[i + 1]}"
            fits_tsv; save
        elif [[ $tiny_skips != *" $name "* ]]; then
            fit "$name" 0 "${fits[i + 1]}" &
            pending+=($!)
            if [ ${#pending[@]} = 2 ]; then wait "${pending[@]}"; pending=(); fits_tsv; save; fi
        fi
    done
    [ ${#pending[@]} = 0 ] || { wait "${pending[@]}"; fits_tsv; save; }
}
run_fits 230 fsdp fsdp-bn-in-blocks vit-sharded ddp-bucket-view gpu

# 5. The real pipeline, GPU decoders then CPU decoders, and compile.
stage nvjpeg 60 170 "${bench[@]}" "${real[@]}" --decoders nvjpeg --out "$out/nvjpeg"
stage torchcodec-cuda 60 140 "${bench[@]}" "${real[@]}" --decoders torchcodec-cuda --out "$out/torchcodec-cuda"
stage cpu-decode 90 120 "${bench[@]}" "${real[@]}" --decoders torchvision,torchcodec --out "$out/cpu-decode"
stage compile 120 100 "${bench[@]}" --variants bf16-mixed+cl+compile --real none --out "$out/compile"

# 6. Our Trainer path against a plain PyTorch loop, alternating on the same device.
if [ "$tiny" = 1 ]; then
    overhead=(--quick --block 2)
else
    overhead=(--accelerator gpu --precision bf16-mixed --channels-last --arch resnet50 --image-size 224
              --batch-size 256 --num-classes 1000 --steps 40 --rounds 2 --block 10 --tolerance 0.05)
fi
stage overhead 60 80 python3 bench/overhead.py "${overhead[@]}" --json "$out/overhead.json"

# 7. Device augmentation, one batch: image by image against batch-wise.
if [ "$tiny" = 1 ]; then augment=(--device cpu --batch 16 --crop 32 --resize 36 --rounds 2); else augment=(--rounds 5); fi
stage augment 30 60 python3 bench/device_augment.py --jpegs "$jpegs" "${augment[@]}" --json "$out/augment.json"

# 8. The same JPEGs as shards (classifier_engine/data/make_shards.py: short side <= 256, re-encoded; a rerun keeps
# finished shards), and a fit on them, decoded in the workers (shards refuse device decoders); the last fits.
stage shards 45 40 python3 -m classifier_engine.data.make_shards --source "$jpegs" --out "$out/shards"
run_fits 0 shards ddp dp fp16
log "done: $out/table.md"
