#!/bin/bash
# The GPU rows of lookahead calibration and Algorithm 1 for a finished calibration stage's model, in one call of
# about 4 minutes on an H200 (docs/bench/calibration_dose_exact.md, docs/bench/sequence_goal_gpu_*.md):
#   B: exact lookahead (every word) beside top-16 at the stage's multiples of its alpha*, on the same prefixes and
#      seeds, with exact lookahead's own alpha* fitted after the rows are written (bench/calibration_dose_row.py);
#   A: the sequence_calibration stage (analysis=cpu) at 64, 128 and 256 particles, twisted and untwisted;
#   C: a finished sequence_calibration run's twisted check on more fresh prefixes (bench/sequence_fresh.py: the run's
#      alpha* and heads, FRESH_RUN its folder, FRESH_HEADS the heads.pt that script wrote where the run ran).
#
#   CKPT=.../best.ckpt CAL=.../calibration/calibration.json [DATA=<folder holding ptb/>] [OUT=outputs/gpu-rows] \
#       [PY=python3] [TB=220] [TA=340] [RULES='top-16 exact'] [B_ARGS='--fit exact'] [PARTICLES='[64,128,256]'] \
#       [A_ARGS='analysis.sequence_calibration.goal_prefixes=150 ...'] [TC=0 FRESH_RUN=... FRESH_HEADS=... \
#       FRESH_PREFIXES=10000:15000 FRESH_PART=1000] bash bench/gpu_algorithm_rows.sh
#
# Algorithm 1's rows are called converged only where K and 2K are shown to agree within converge_tol (0.1 nats) at 2
# standard errors, which 20 or 60 prefixes cannot show (paired standard errors 0.14-0.26 nats;
# bench/convergence_rule.py). On the CPU, with alpha* fitted on all 184 disjoint validation continuations, twisted SMC
# at 16 and 32 particles differ by +0.034 +- 0.040 nats on 1,800 generations a row (not shown;
# docs/bench/sequence_goal_cpu_precise.md) and by +0.010 +- 0.027 nats on 3,600 (each grown by seed 1000 with
# extend_json): converged at 16 particles (docs/bench/sequence_goal_cpu_3600.md). What is left undecided is the level:
# 16 particles give 106.5 +- 3.5 on 600 fresh prefixes (1,800 generations) against 115.8 and its 10% (104.2-127.4).
# The study's own prefixes cannot decide it: its 600 prefixes' spread dominates (107.5 +- 2.6, 106.5 +- 2.3, 106.7 +-
# 2.0 at 6, 9 and 15 generations a prefix: docs/bench/sequence_goal_cpu_3600.md, _5400.md, _9000.md). Fresh prefixes
# can: about 5,554 at 3 generations each decide 106.5 (_9000.md's last verdict, lmcal.reporting.claims.units_to_decide).
# Those figures are the 2026-11-28 model's; its run and its 3,000 measured prefixes were lost with a scratch disk
# (docs/bench/sequence_fresh_runA5.md). The model retrained on 2026-11-29 has its run in git (alpha* 0.00890).
# The GPU's question, in one call, part C alone: that row itself (the CPU run kept in git,
# docs/bench/sequence_fresh/run, its alpha* and its heads, read from the heads.pt bench/sequence_fresh.py wrote on the
# CPU; CKPT the checkpoint that run was made from, which git does not keep: a retrained one must give the run's test
# CE, or part C refuses) on fresh prefixes 10,000 and up, clear of the CPU's parts (which grow from 0); no heads
# trained, no alpha fitted:
# TB=0 TA=0 TC=540 FRESH_RUN=docs/bench/sequence_fresh/run FRESH_HEADS=.gpu/heads.pt FRESH_PREFIXES=10000:15000
# FRESH_PART=1000 in a call of timeout_s=600 (15,000 generations at 16 particles; at
# docs/bench/sequence_goal_gpu_500.md's rate, 1,500 twisted generations at 64 particles with their nested runs in 64 s
# at max_batch=4096, about 3 minutes: an estimate, not measured; each part of 1,000 prefixes is kept as it finishes,
# so a timeout loses one part). Copy OUT/fresh/part_*.json into docs/bench/sequence_fresh/, commit them, and write the
# verdict: `python bench/sequence_fresh.py --run docs/bench/sequence_fresh/run --dir docs/bench/sequence_fresh
# --planned 5600 --out docs/bench/sequence_fresh.md` (5,600 prefixes in all, fixed from the first 600 before the rest
# were measured: size FRESH_PREFIXES to bring the parts to that count). The
# stage's own study at 16 and 32 on the GPU, with its own heads and alpha* (whose spread moves a run's level by about
# +-0.1 nats), is part A with
# PARTICLES='[16,32]' A_ARGS='analysis.sequence_calibration.num_prefixes=600
# analysis.sequence_calibration.smc_seeds=[0,1000] analysis.sequence_calibration.untwisted=false
# analysis.sequence_calibration.sv_alpha=0.01122512358938793 analysis.sequence_calibration.fit_prefixes=184
# analysis.sequence_calibration.goal_prefixes=3200 analysis.sequence_calibration.max_batch=8192' TA=570 TB=0 (about 8
# minutes, estimated: the heads took 3.5 minutes in the _500.md run).
# The issue's own GPU rows, 64 and 256 particles twisted and untwisted, are the default PARTICLES with
# A_ARGS='analysis.sequence_calibration.goal_prefixes=150', a second call.
#
# On a bare GPU machine whose Python lacks Hydra and OmegaConf, bring .whl/ (`make gpu-wheels`) and set WHEELS=1.
# Each part has its own timeout (TB, TA, TC seconds; 0 skips it); what they write lands flat in OUT (the rows' JSON,
# the stage's JSON, Markdown, figure and evaluation.json, log.txt), C's parts in OUT/fresh. Then, here: copy
# OUT/dose_rows_exact.json beside CAL and run `python bench/calibration_dose_row.py --calibration CAL --report <page>`,
# and `python bench/sequence_goal.py --dir OUT --out <page>` (it reads the finished stage; no checkpoint needed).
set -u
cd "$(dirname "$0")/.."
: "${CKPT:?set CKPT to the model's checkpoint}"
DEV=${DEV:-cuda}; TB=${TB:-220}; TA=${TA:-340}; PY=${PY:-python3}
[ "$TB" = 0 ] || : "${CAL:?set CAL to the calibration stage's calibration.json (or TB=0 to skip part B)}"
OUT=${OUT:-outputs/gpu-rows}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/log.txt") 2>&1
if [ "${WHEELS:-0}" = 1 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lmcal-site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/lmcal-site:$PWD/src
fi
export PYTHONUNBUFFERED=1
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
DATA_ARGS=(); [ -n "${DATA:-}" ] && DATA_ARGS=(--data-root "$DATA")
date -u +"start %H:%M:%S"

if [ "$TB" != 0 ]; then  # TB=0 (TA=0, TC=0) skips a part
  echo "=== B: exact lookahead beside top-16"
  # shellcheck disable=SC2086  # RULES and B_ARGS are word lists
  timeout "$TB" $PY bench/calibration_dose_row.py --ckpt "$CKPT" "${DATA_ARGS[@]}" --calibration "$CAL" \
    --device "$DEV" --rules ${RULES:-top-16 exact} ${B_ARGS:---fit exact} --out "$OUT/dose_rows_exact.json"
  echo "B rc=$? at $(date -u +%H:%M:%S)"
fi

if [ "$TA" != 0 ]; then
  echo "=== A: sequence_calibration at ${PARTICLES:-[64,128,256]} particles"
  RUN=$(mktemp -d)
  # shellcheck disable=SC2086  # A_ARGS is a list of overrides
  timeout "$TA" $PY -m lmcal.evaluate ckpt="$CKPT" ${DATA:+data_root="$DATA"} 'stages=[sequence_calibration]' \
    analysis=cpu logger=none device="$DEV" "analysis.sequence_calibration.particles=${PARTICLES:-[64,128,256]}" \
    analysis.sequence_calibration.max_batch=4096 ${A_ARGS:-} hydra.run.dir="$RUN"
  echo "A rc=$? at $(date -u +%H:%M:%S)"
  find "$RUN" \( -name 'sequence_calibration.*' -o -name evaluation.json \) -exec cp {} "$OUT/" \;
fi

if [ "${TC:-0}" != 0 ]; then
  : "${FRESH_RUN:?set FRESH_RUN to the folder of a finished sequence_calibration run (or TC=0)}"
  echo "=== C: ${FRESH_RUN}'s twisted check on fresh prefixes ${FRESH_PREFIXES:-10000:15000}"
  timeout "$TC" $PY bench/sequence_fresh.py --run "$FRESH_RUN" --dir "$OUT/fresh" --ckpt "$CKPT" "${DATA_ARGS[@]}" \
    --device "$DEV" --prefixes "${FRESH_PREFIXES:-10000:15000}" --part "${FRESH_PART:-1000}" --max-batch 8192 \
    ${FRESH_HEADS:+--heads "$FRESH_HEADS"}
  echo "C rc=$? at $(date -u +%H:%M:%S)"
fi
date -u +"end %H:%M:%S"
