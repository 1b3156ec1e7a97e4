#!/bin/bash
# Session 33: the best recipe from nothing (session 32's run32.sh: cosine floor 0.1) beside other
# floors of the cosine (--min-lr-ratio), same data, seed and steps; one thread each, side by side.
# Usage: arms.sh NAME [extra train.py flags]  (e.g. arms.sh s33-minlr03 --min-lr-ratio 0.3).
# Run from anywhere; DATA and RUNS default to /root/eagle3/{data,runs} (data.sh makes the data).
# Resumable: rerun the same line; it adds --resume once the run has a checkpoint.
cd "$(dirname "$0")/../.."; D=${DATA:-/root/eagle3/data}/s4243; R=${RUNS:-/root/eagle3/runs}
out=$R/$1; shift; mkdir -p $R
res=""; [ -d $out/checkpoints ] && res="--resume"
OMP_NUM_THREADS=1 python train.py --data $D --out $out --offline --ttt-length 3 --optimizer muon \
  --lr 3e-3 --batch-size 2 --ttt-decay 0.5 --lm-head-init target \
  --draft-config results/levers-s33/e31.json --warmup 0.03 --epochs 2 --eval-fraction 0.03 \
  --eval-every 200 --save-every 50 --keep 60 --keep-best --threads 1 --seed 0 --no-progress \
  $res "$@" > $out.log 2>&1
