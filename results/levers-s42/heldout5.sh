#!/bin/bash
# Held-out numbers of one draft at TTT 5 (steps 0..4) on s3738's 5% split (seed 0: the arms' own
# 141 conversations): step 0 of a run that starts from the draft (--stop-at 1 evaluates before any
# update). Usage: heldout5.sh DRAFT_DIR NAME -> /root/eagle3/runs/s42-h5-NAME/log.jsonl
cd /root/eagle3/code-s42; R=/root/eagle3/runs/s42-h5-$2; rm -rf $R
OMP_NUM_THREADS=1 python train.py --data /root/eagle3/data/s3738 --out $R --init $1 --offline \
  --ttt-length 5 --eval-fraction 0.05 --stop-at 1 --dtype float32 --lr 1e-9 --batch-size 2 \
  --threads 1 --seed 0 --no-progress > $R.log 2>&1
head -1 $R/log.jsonl
