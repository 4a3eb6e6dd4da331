#!/usr/bin/env bash
# One call of the device tool on a TPU host: every benchmark a chip session owes
# issue 39, each bounded by its own timeout and by the call's budget, logs to $OUT.
#
#   bash tools/tpu_session.sh PART [BUDGET_SECONDS]
#
# PART: table-hand | table-splash | table-dew | families | decode | profile | policy.
# Run from the project root of the device's copy, after
# `source .tpu/host_env.sh` (docs/performance.md, "On a TPU v5e chip"), with
# JAX_COMPILATION_CACHE_DIR set; a machine's start costs minutes of the session's
# device time, so put as much as fits into one call. One line a run goes to
# $OUT/summary.txt (name, exit code, seconds); a run that would start with under
# 30 s of budget left is skipped and named there.
set -u
PART=${1:?give a part}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/p
END=$(( $(date +%s) + ${2:-540} ))
run() {  # run NAME MAX_SECONDS COMMAND...
  local name=$1 max=$2 left t
  shift 2
  left=$(( END - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "skip $name (budget)" >> "$OUT/summary.txt"; return; fi
  [ "$max" -gt "$left" ] && max=$left
  t=$(date +%s)
  rm -f /tmp/libtpu_lockfile  # a run killed at its timeout leaves the chip locked
  OUT=/tmp/p timeout "$max" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t ))s" >> "$OUT/summary.txt"
}
B="python -u tools/bench_tpu.py --steps 20"
case $PART in
  table-hand | table-splash | table-dew)
    side=${PART#table-}
    [ "$side" = dew ] && side=dew,dew_loop
    run "${side%%,*}" 600 $B --suite table --only "$side" --out "$OUT/${side%%,*}.jsonl" ;;
  families)
    run dpo 90 python -u tools/bench_dpo.py --size small --steps 30 --repeats 2
    run grpo 90 python -u tools/bench_grpo.py --size small --iterations 6 --repeats 2
    run diffusion 90 python -u tools/bench_diffusion.py --parts train --repeats 2
    run jepa 90 python -u tools/bench_jepa.py --parts train --repeats 2
    run token 90 python -u tools/bench_token_diffusion.py --parts train --repeats 2
    run flow 90 python -u tools/bench_flow_grpo.py --repeats 3
    run distill 90 python -u tools/bench_distill.py ;;
  decode)
    run generate 300 python -u tools/bench_generate.py --sizes tiny,small --repeats 3 ;;
  policy)  # the scanned stack keeping what a loop of blocks keeps, against the loop
    run prof 330 python -u tools/profile_tpu_step.py hand_loop hand_scan@save_matmul_inputs \
      fit_scan@save_matmul_inputs hand_loop_select_unorm hand_loop_select_unorm_fused
    run dew16 130 $B --side dew --batch 16 --remat save_matmul_inputs
    run dew4 110 $B --side dew --batch 4 --remat save_matmul_inputs ;;
  profile)
    run prof 540 python -u tools/profile_tpu_step.py hand_loop hand_loop_select_unorm \
      hand_loop_select_unorm_fused fit_loop hand_scan fit_scan ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
cat "$OUT/summary.txt"
