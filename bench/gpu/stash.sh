#!/usr/bin/env bash
# On the device: keep whichever wheel folders this call carried (.gpu/a, .gpu/b, .gpu/deps) in /tmp/gpu, where
# h200_speed.sh and h200_pipeline.sh install from. One call carries at most 64 MiB with the working tree, so the
# wheels travel over three calls, each `bash bench/gpu/stash.sh` (the machine stays warm 30 s between calls):
#   call 1: carry .gpu/a     (the first half of mlx-cuda-13)
#   call 2: carry .gpu/b     (its second half and checksum, mlx, mlx-lm)
#   call 3: carry .gpu/deps  (the server's dependencies), then run the benchmark in the same command
# Prepare the three folders here with bench/gpu/prepare_wheels.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/gpu
for part in a b deps; do
  if [ -d ".gpu/$part" ]; then rm -rf "/tmp/gpu/$part" && cp -r ".gpu/$part" /tmp/gpu/ && echo "stashed .gpu/$part"; fi
done
du -sh /tmp/gpu/* 2>/dev/null || true
