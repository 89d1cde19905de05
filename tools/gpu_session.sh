#!/usr/bin/env bash
# One device-tool call's worth of GPU work, each step time-boxed so the call ends inside the 10-minute
# limit. Run from the repository root on the H200; several steps in one call share the warm cache:
#
#   bash tools/gpu_session.sh correctness     # every GPU test, with the error and leak reports
#   bash tools/gpu_session.sh matrix [--quick] # the benchmark matrix against the peers (tools.bench_matrix)
#   bash tools/gpu_session.sh safety          # compute-sanitizer memcheck and racecheck, every kernel family
#   bash tools/gpu_session.sh speed           # the older per-path benchmarks and sweeps
#
# Each step's output lands in ./gpu-session-out/<step>; where the device tool's $OUT is set, the whole
# folder is also packed into $OUT/gpu-session.tgz (the tool brings back few files, so one archive).
set -uo pipefail
work="$PWD/gpu-session-out"
mkdir -p "$work"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HIPATTN_CACHE_DIR="${HIPATTN_CACHE_DIR:-/tmp/hipattn-cache}"

step() {  # step SECONDS NAME COMMAND...: run, keep the log, print its tail
  local seconds=$1 name=$2
  shift 2
  echo "== $name ($(date +%T))"
  timeout "$seconds" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$work/$name.log"
  echo "== $name: exit $rc"
}

pack() {
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu-session.tgz" -C "$work" .
  fi
}
trap pack EXIT

# The kernels every step needs, compiled in parallel first (seconds once the cache holds them).
step 180 warm python3 -m hipattn warm --arch sm_90a -j 16

mode="${1:-correctness}"
shift || true
case "$mode" in
  correctness)
    step 330 pytest env HIPATTN_ERROR_REPORT="$work/errors.json" HIPATTN_LEAK_REPORT="$work/leaks.json" \
      python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$work/pytest.xml" tests/gpu
    ;;
  matrix)
    step 560 matrix python3 -m tools.bench_matrix --no-warm --out "$work/matrix" "$@"
    ;;
  safety)
    step 330 sanitize env SANITIZE_LOG_DIR="$work/sanitize" SANITIZE_TOOLS="memcheck racecheck" \
      bash tools/sanitize.sh --quick "$@"
    ;;
  speed)
    step 330 smallseq python3 -m tools.bench_smallseq --out "$work/bench_smallseq.json"
    step 240 flash python3 -m tools.bench_flash --out "$work/bench_flash.json" --workloads 1024,4096,16384,varlen
    step 60 host python3 -m tools.bench_host_overhead --out "$work/bench_host.json"
    ;;
  *)
    echo "usage: $0 correctness|matrix [--quick]|safety|speed" >&2
    exit 2
    ;;
esac
