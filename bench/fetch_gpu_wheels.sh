#!/usr/bin/env bash
# Download, on a machine with network, the wheels a GPU machine without it lacks: jsonargparse and its `signatures`
# extra (docstring-parser, typeshed-client), and TorchCodec, for CPython 3.12 on x86-64 Linux. bench/gpu_all.sh
# installs them from .whl/ when `import jsonargparse` fails there.
#   bash bench/fetch_gpu_wheels.sh                 # into .whl/ (git-ignored), ~10 MB
#   PYTHON_VERSION=3.11 bash bench/fetch_gpu_wheels.sh
# The pins are the versions this project was tested with (jsonargparse 4.53, torchcodec 0.17 needs torch >= 2.11).
set -euo pipefail
cd "$(dirname "$0")/.."

dest=${WHEELS:-.whl}
python_version=${PYTHON_VERSION:-3.12}
mkdir -p "$dest"
# Pure-Python wheels (py3-none-any) and torchcodec's manylinux one; --no-deps: the GPU machine has PyYAML,
# typing-extensions and torch already, and two versions of one package would stop the offline install.
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    "${platforms[@]}" -d "$dest" \
    jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 torchcodec==0.17.0
ls -l "$dest"
