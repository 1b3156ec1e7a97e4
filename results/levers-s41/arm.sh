#!/bin/bash
# Session 41: one arm against arms.sh's base (same flags, seed, data, 1000 steps), one thread.
# The two that ran (/root/eagle3/b41/arm2.sh, arm3.sh) were this with their names and flags
# written in:
#   ./arm.sh layer29s --layer-init-from -1      # code snapshot /root/eagle3/code-s41b (94cc16f)
#   ./arm.sh topk32 --distill-topk 32
# Resumable: rerun the same command (it adds --resume where the run has checkpoints).
name=$1; shift
cd /root/eagle3/code-s41b
out=/root/eagle3/runs/s41-$name
extra=""; ls $out/checkpoints/step-* > /dev/null 2>&1 && extra="--resume"
echo "start $(date -u +%T)"
OMP_NUM_THREADS=1 python train.py --data /root/eagle3/data/s3738 --out $out --offline \
  --ttt-length 3 --optimizer muon --lr 3e-3 --batch-size 2 --ttt-decay 0.5 --lm-head-init target \
  --draft-config /root/eagle3/e31.json --warmup 0.03 --max-steps 1000 --weight-decay 0.3 \
  --eval-fraction 0.05 --eval-every 250 --save-every 50 --keep 2 --threads 1 --seed 0 \
  --no-progress "$@" $extra > /root/eagle3/b41/$name.log 2>&1
echo "done $(date -u +%T)"
