#!/usr/bin/env bash
# Download (here, where PyPI is reachable) what the H200 run needs, for the device's Python 3.12, into .gpu/a,
# .gpu/b and .gpu/deps (each, with the working tree, under the device tool's 64 MiB per call; keep .gpu out of git:
# .git/info/exclude). bench/gpu/stash.sh keeps them on the device, one call each.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
dl=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64)
rm -rf .gpu/b/deps && mkdir -p .gpu/a .gpu/b .gpu/deps .gpu/dl
"$py" "${dl[@]}" -d .gpu/dl mlx-cuda-13==0.32.4 mlx==0.32.4 mlx-lm==0.32.2
# the server's runtime dependencies at the versions this venv runs
"$py" -m pip freeze | grep -iE '^(cryptography|cffi|pycparser|fastapi|starlette|uvicorn|pydantic|pydantic.core|annotated.types|annotated.doc|typing.extensions|typing.inspection|opentelemetry.api|prometheus.client|tomli.w|httpx|httpcore|h11|anyio|sniffio|idna|certifi|click)==' > .gpu/req.txt
"$py" "${dl[@]}" -d .gpu/deps -r .gpu/req.txt
wheel=.gpu/dl/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
(cd .gpu/dl && sha256sum "$(basename "$wheel")") > .gpu/b/cuda.sha256
split -b 44M "$wheel" .gpu/dl/cuda.part.
mv .gpu/dl/cuda.part.aa .gpu/a/ && mv .gpu/dl/cuda.part.ab .gpu/b/
cp .gpu/dl/mlx-0.32.4-*.whl .gpu/dl/mlx_lm-*.whl .gpu/b/
du -sh .gpu/a .gpu/b .gpu/deps
