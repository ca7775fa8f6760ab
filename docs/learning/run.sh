#!/usr/bin/env bash
# The runs behind docs/learning.md, on one GPU: bash docs/learning/run.sh OUT SHAKESPEARE_TXT [phase]
#   phase sweep: dormouse `small` (dropout 0 / 0.1 / 0.2) and the GPT baseline on a 1.1 MB text,
#                both on a 1 MiB slice of the default corpus and on the whole default corpus;
#                trained concurrently on the one card (the loss curves are exact; their
#                wall-clock is shared, so time comparisons come from the solo phase)
#   phase solo:  the chosen defaults, one run at a time (wall-clock comparable)
# Each run: batch 64 x 256 bytes, eval every 50 steps on 8 batches, 1250 steps (>= 20 passes
# of a 1 MB corpus). The first dormouse run tunes fla's kernels alone; the rest reuse the cache.
set -uo pipefail
OUT=$1; SHAKES=$2; PHASE=${3:-sweep}
mkdir -p "$OUT"
DEF=$(python3 -c "from dormouse.train.data import default_corpus; print(default_corpus('$OUT/cache'))" 2>/dev/null)
head -c 1048576 "$DEF" > "$OUT/d1m.txt"
COMMON="--set batch=64 --set seq_len=256 --set eval_every=50 --set eval_batches=8 --set ckpt_every=0 --set log_every=50"
STEPS=${STEPS:-1250}
run() {  # name preset data... -- sets...
  local name=$1 preset=$2; shift 2
  python3 -m dormouse train "$preset" --steps "$STEPS" --out "$OUT/$name" --overwrite $COMMON "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$(date +%T) $name rc=$?" >> "$OUT/done.txt"
}
SH="--data $SHAKES --set val_bytes=111540"
D1="--data $OUT/d1m.txt --set val_frac=0.1"
if [ "$PHASE" = sweep ]; then
  # the first dormouse run autotunes fla's kernels for this shape; wait for its first step
  run sh-small-d1 small $SH --set dropout=0.1 &
  for _ in $(seq 1 400); do grep -q "step=50 " "$OUT/sh-small-d1.log" 2>/dev/null && break; sleep 1; done
  echo "$(date +%T) autotune done" >> "$OUT/done.txt"
  run sh-small-d0 small $SH --set dropout=0.0 &
  run sh-small-d2 small $SH --set dropout=0.2 &
  run sh-gpt gpt-small $SH &
  run d1m-small-d1 small $D1 --set dropout=0.1 &
  run d1m-gpt gpt-small $D1 &
  run full-small-d1 small --set dropout=0.1 &
  run full-gpt gpt-small &
  wait
elif [ "$PHASE" = sweep2 ]; then
  # which knob stops `small` memorising: all with dropout 0.2 (the best of sweep) but one
  run sh-d3 small $SH --set dropout=0.3 &
  run sh-d2-elr1 small $SH --set dropout=0.2 --set engram_lr_mult=1 &
  run sh-d2-lr15 small $SH --set dropout=0.2 --set lr=1.5e-3 &
  run sh-d2-wd5 small $SH --set dropout=0.2 --set wd=0.5 &
  run sh-d2-rows4k small $SH --set dropout=0.2 --set engram_rows=4096 &
  run d1m-d2 small $D1 --set dropout=0.2 &
  wait
elif [ "$PHASE" = sweep3 ]; then
  # solo step times (each alone on the card: the wall-clock axis), then dropout 0.3/0.4
  STEPS=150 run solo-small small $SH --set dropout=0.3
  STEPS=150 run solo-gpt gpt-small $SH
  run sh-d4 small $SH --set dropout=0.4 &
  run d1m-d3 small $D1 --set dropout=0.3 &
  run d1m-d4 small $D1 --set dropout=0.4 &
  run full-small-d0 small --set dropout=0.0 &
  wait
else
  run solo-sh-small small $SH "${@:4}"
  run solo-sh-gpt gpt-small $SH
fi
