#!/bin/bash
# Session 41: --layer-init-from -1 (the draft's decoder layer starts as the target's last layer)
# against the shipped recipe, from nothing, side by side, one thread each, same seed, same data
# (s3738, 5% held out = the ship run's 141 conversations), 1000 steps (~737k tokens, < 1 epoch).
# Resumable: rerun this script (it adds --resume where a run has checkpoints).
cd /root/eagle3/code-s41
run() {
  name=$1; shift
  out=/root/eagle3/runs/s41-$name
  extra=""; ls $out/checkpoints/step-* > /dev/null 2>&1 && extra="--resume"
  OMP_NUM_THREADS=1 python train.py --data /root/eagle3/data/s3738 --out $out --offline \
    --ttt-length 3 --optimizer muon --lr 3e-3 --batch-size 2 --ttt-decay 0.5 --lm-head-init target \
    --draft-config /root/eagle3/e31.json --warmup 0.03 --max-steps 1000 --weight-decay 0.3 \
    --eval-fraction 0.05 --eval-every 250 --save-every 50 --keep 2 --threads 1 --seed 0 \
    --no-progress $extra "$@" > /root/eagle3/b41/$name.log 2>&1
}
echo "start $(date -u +%T)"
run base &
run layer29 --layer-init-from -1 &
wait
echo "done $(date -u +%T)"
