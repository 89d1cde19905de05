#!/usr/bin/env bash
# One device-tool call's worth of GPU validation, in priority order, each step time-boxed so the
# call ends inside the 10-minute limit. Run from the repository root on the H200:
#
#   bash tools/gpu_session.sh correctness   # warm the cache, every GPU test, the backend check
#   bash tools/gpu_session.sh speed         # small-seq and flash benchmarks against peers
#   bash tools/gpu_session.sh safety        # compute-sanitizer over every kernel family (quick set)
#
# Results land in $OUT (the device tool's return folder) or ./gpu-session-out.
set -uo pipefail
out="${OUT:-$PWD/gpu-session-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HIPATTN_CACHE_DIR="${HIPATTN_CACHE_DIR:-/tmp/hipattn-cache}"

step() {  # step SECONDS NAME COMMAND...: run, keep the log, print its tail
  local seconds=$1 name=$2
  shift 2
  echo "== $name"
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 8 "$out/$name.log"
  echo "== $name: exit $rc"
}

# The kernels every step needs, compiled in parallel first (about 30 s on the H200's 16 cores).
step 240 warm python3 -m hipattn warm -j 16

case "${1:-correctness}" in
  correctness)
    step 300 pytest env HIPATTN_ERROR_REPORT="$out/errors.json" HIPATTN_LEAK_REPORT="$out/leaks.json" \
      python3 -m pytest -q -rs tests/gpu
    step 60 backend python -m tools.gpu_check_backend
    ;;
  speed)
    step 330 smallseq python -m tools.bench_smallseq --out "$out/bench_smallseq.json"
    step 240 flash python -m tools.bench_flash --out "$out/bench_flash.json" --workloads 1024,4096,16384,varlen
    step 60 backward_tiles python -m tools.sweep_flash_backward --out "$out/sweep_flash_backward.json"
    step 60 varlen_prep python -m tools.bench_varlen_prep --out "$out/bench_varlen_prep.json"
    step 60 host python -m tools.bench_host_overhead --out "$out/bench_host.json"
    ;;
  safety)
    step 330 sanitize env SANITIZE_LOG_DIR="$out/sanitize" bash tools/sanitize.sh --quick
    ;;
  *)
    echo "usage: $0 correctness|speed|safety" >&2
    exit 2
    ;;
esac
