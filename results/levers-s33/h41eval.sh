#!/bin/bash
# Replayed accept length of one draft on the fixed held-out set h41 (data.sh), in fp32: step 0 of
# a run that starts from the draft (--stop-at 1 evaluates before any update; 90 of h41's 100
# conversations, 24,541 rows). Usage: h41eval.sh DRAFT_DIR NAME -> $RUNS/h41-s33-NAME/log.jsonl
cd "$(dirname "$0")/../.."; H=${DATA:-/root/eagle3/data}/h41; R=${RUNS:-/root/eagle3/runs}/h41-s33-$2
rm -rf $R
OMP_NUM_THREADS=1 python train.py --data $H --out $R --init $1 --offline --ttt-length 3 \
  --eval-fraction 0.9 --stop-at 1 --dtype float32 --lr 1e-9 --batch-size 2 --threads 1 --seed 0 \
  --no-progress > $R.log 2>&1
head -1 $R/log.jsonl
