#!/bin/bash
# Session 42: one arm against s41-base (same flags, seed, data), one thread; name, max steps, flags.
# Resumable: rerun the same command (it adds --resume where the run has checkpoints).
name=$1; steps=$2; shift 2
cd /root/eagle3/code-s42
out=/root/eagle3/runs/s42-$name
extra=""; ls $out/checkpoints/step-* > /dev/null 2>&1 && extra="--resume"
echo "start $name $(date -u +%T)"
OMP_NUM_THREADS=1 python train.py --data /root/eagle3/data/s3738 --out $out --offline \
  --ttt-length 3 --optimizer muon --lr 3e-3 --batch-size 2 --ttt-decay 0.5 --lm-head-init target \
  --draft-config /root/eagle3/e31.json --warmup 0.03 --max-steps $steps --weight-decay 0.3 \
  --eval-fraction 0.05 --eval-every 250 --save-every 50 --keep 2 --threads 1 --seed 0 \
  --no-progress "$@" $extra >> /root/eagle3/b42/$name.log 2>&1
echo "done $name $(date -u +%T)"
