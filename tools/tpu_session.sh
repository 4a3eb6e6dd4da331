#!/usr/bin/env bash
# One call of the device tool on a TPU host: every benchmark a chip session owes
# issue 39, each bounded by its own timeout and by the call's budget, logs to $OUT.
#
#   bash tools/tpu_session.sh PART [BUDGET_SECONDS]
#
# PART: table-hand | table-splash | table-dew | families | families-a | families-b |
#   families-c | families-d | decode | profile | flags | context | layout | policy | big.
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
export HLO_DIR=/tmp/p  # the RL benchmarks' --hlo: each update's compiled HLO (kept below)
END=$(( $(date +%s) + ${2:-540} ))
run() {  # run NAME MAX_SECONDS COMMAND...
  local name=$1 max=$2 left t
  shift 2
  case " ${SKIP:-} " in *" $name "*) return ;; esac  # SKIP="dpo grpo": runs done already
  left=$(( END - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "skip $name (budget)" >> "$OUT/summary.txt"; return; fi
  [ "$max" -gt "$left" ] && max=$left
  t=$(date +%s)
  rm -f /tmp/libtpu_lockfile  # a run killed at its timeout leaves the chip locked
  OUT=/tmp/p timeout -k 5 "$max" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t ))s" >> "$OUT/summary.txt"
}
keep_hlo() {  # the compiled programs profile_tpu_step wrote, gzipped into $OUT
  for f in /tmp/p/*.hlo.txt; do
    [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f" | tr -c 'a-zA-Z0-9._\n' '_').gz"
  done
}
B="python -u tools/bench_tpu.py --steps 20"
case $PART in
  table-hand | table-splash | table-dew)
    side=${PART#table-}
    [ "$side" = dew ] && side=dew,dew_loop
    run "${side%%,*}" 600 $B --suite table --only "$side" --out "$OUT/${side%%,*}.jsonl" ;;
  families | families-a | families-b | families-c | families-d)
    # each tool's chip-sized step ("tpu"), one process each. Their compiles dominate: on
    # the chip (2026-12-07) DiT's run took 143 s, JEPA's 194-330 s, DPO's 196 s, GRPO's
    # 318 s, PPO's about 330 s, distillation's 293 s, and token diffusion and Flow-GRPO
    # had not printed a result after 190-200 s each (their compile caches then warm); alone
    # (2026-12-07, sixth) MDLM took 128 s, BD3-LM 154 s, Flow-GRPO's rollout 130 s and
    # update 181 s, GRPO 335 s. A call of 600 s holds: families-a (MDLM, BD3-LM), -b
    # (Flow-GRPO; distillation: measured), -c (DPO, GRPO), -d (DiT, JEPA, PPO: measured);
    # families: all, in order
    case $PART in families | families-a)
      for o in mdlm bd3; do  # each objective its own process and timeout
        run "token_$o" 285 python -u tools/bench_token_diffusion.py --size tpu --parts train \
          --objectives "$o" --steps 8 --repeats 3
      done ;;
    esac
    case $PART in families | families-b)
      for part in rollout update; do  # the update's run reads Dew's rollout from the cache
        run "flow_$part" 280 python -u tools/bench_flow_grpo.py --size tpu --repeats 5 \
          --fit-steps 0 --parts "$part"
      done
      if [ "$PART" = families ]; then
        run distill 320 python -u tools/bench_distill.py --size tpu --skip-memory --steps 10
      fi ;;
    esac
    case $PART in families | families-c)
      run dpo 220 python -u tools/bench_dpo.py --size tpu --steps 5 --repeats 1 \
        --parts interleaved
      run grpo 400 python -u tools/bench_grpo.py --size tpu --repeats 0 --calls 6 --hlo \
        --trace /tmp/p/trace_grpo ;;
    esac
    case $PART in families | families-d)
      run diffusion 190 python -u tools/bench_diffusion.py --size tpu --parts train --steps 10 \
        --repeats 1
      run jepa 330 python -u tools/bench_jepa.py --parts train --train-sizes tpu --steps 10 \
        --repeats 1
      run ppo 340 python -u tools/bench_ppo.py --size tpu --repeats 0 --calls 6 --hlo \
        --trace /tmp/p/trace_ppo ;;
    esac
    keep_hlo ;;
  decode)
    run generate 300 python -u tools/bench_generate.py --sizes tiny,small --repeats 3 --hlo ;;
  policy)  # the scanned stack keeping what a loop of blocks keeps, against the loop
    run prof 330 python -u tools/profile_tpu_step.py hand_loop hand_scan@save_matmul_inputs \
      fit_scan@save_matmul_inputs hand_loop_select_unorm hand_loop_select_unorm_fused
    run dew16 130 $B --side dew --batch 16 --remat save_matmul_inputs
    run dew4 110 $B --side dew --batch 4 --remat save_matmul_inputs ;;
  profile)  # where fit's step loses to the plain one: the plain step with fit's guard
    # (unordered, as on a TPU: ordered it was slower there, tenth session of
    # docs/performance.md), the same with fit's logged update norm (lax.cond: the
    # updates again in the branch, as fit now; the updates tree as its operand, as fit
    # until 2026-12-07) and with the norm taken every step (fused into the update), then
    # fit's own step, all the loop of blocks; each run about 120 s on the chip, each
    # writes its compiled HLO (SKIP=prof and the names by hand, to split it in two)
    run prof 590 python -u tools/profile_tpu_step.py hand_loop_select hand_loop_select_unorm \
      hand_loop_select_unorm_updates fit_loop hand_loop_select_unorm_fused
    keep_hlo ;;
  flags)  # the scanned default with the compiler options MaxText and AXLearn set on TPUs
    # (profile_tpu_step.py OPTIONS: a larger scoped VMEM, the experimental scheduler), then
    # fit's step beside the plain step with fit's guard and norm, each with its HLO
    run prof_flags 300 python -u tools/profile_tpu_step.py hand_scan@minimal \
      hand_scan@minimal+vmem hand_scan@minimal+sched hand_scan@minimal+both
    run prof_fit 280 python -u tools/profile_tpu_step.py hand_loop_select_unorm fit_loop
    keep_hlo ;;
  context)  # "minimal" (the scanned default on a TPU) runs the attention's forward kernel
    # twice a layer (twelfth session: 24 splash_mha_fwd a step, 6.7-6.9 ms each 12);
    # "minimal_with_context" keeps its output and log-sum-exp, and its jaxpr has one a
    # layer, yet it measured 0.5 ms faster, not 6.8 (seventh session): its trace and HLO
    run prof 420 python -u tools/profile_tpu_step.py hand_scan@minimal_with_context \
      hand_scan_select_unorm_after@minimal_with_context
    keep_hlo ;;
  layout)  # the scanned default's gap to the loop of blocks (0.83x the splash loop): its
    # layout copies, with the weights and optimizer state in the layouts XLA picks
    run prof 420 python -u tools/profile_tpu_step.py hand_scan@minimal hand_scanauto@minimal
    keep_hlo ;;
  big)  # a 1.1B Llama-style decoder (TinyLlama's shape) with bfloat16 weights and AdamW state:
    # at seq 2048 batch 4 the default ("minimal") is refused before it runs (17.14 GiB
    # needed, 2026-12-07) and "full" trains (41.0% MFU); what lies between
    L="--model llama --emb 2048 --layers 22 --heads 32 --kv-heads 4 --mlp 5632"
    L="$L --param-dtype bfloat16 --seq 2048"
    run llama1b_qkv 200 $B --side dew $L --batch 4 --remat save_qkv_proj
    run llama1b_dot 200 $B --side dew $L --batch 4 --remat save_dot_except_mlp
    run llama1b_b2 180 $B --side dew $L --batch 2 ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
cat "$OUT/summary.txt"
