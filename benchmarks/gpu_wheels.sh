#!/usr/bin/env bash
# Wheels that benchmarks/gpu_check.py needs on a GPU machine without a package registry
# (its image has torch 2.11, transformers, peft, accelerate, safetensors, pyyaml, numpy;
# not pydantic or torchao). Run here, carry the folder there, install with:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl
#   PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/gpu_check.py --out OUT
#
# Versions: pydantic's set as in this project's environment; torchao 0.18.0 loads its
# C++ extensions from torch 2.11 on (abi3 wheel; float8 training itself is Python+Triton).
set -euo pipefail
dest="${1:-.whl}"
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2 typing-extensions==4.16.0 torchao==0.18.0
ls -1 "$dest"
