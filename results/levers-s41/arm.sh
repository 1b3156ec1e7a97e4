#!/bin/bash
# One arm against the shipped recipe from nothing (arms.sh's base: same flags, seed, data), one
# thread: ./arm.sh NAME FLAGS. Session 41's defaults; later sessions set SESSION, STEPS (the arm's
# own full cosine) and CODE (its code snapshot). The arms that ran:
#   ./arm.sh layer29s --layer-init-from -1      # session 41, /root/eagle3/code-s41b (94cc16f)
#   ./arm.sh topk32 --distill-topk 32           # session 41
#   SESSION=42 STEPS=850 CODE=/root/eagle3/code-s42 ./arm.sh ttt4 --ttt-length 4   # 3dd24cd
#   SESSION=42 STEPS=780 CODE=/root/eagle3/code-s42 ./arm.sh ttt5 --ttt-length 5
#   SESSION=42 STEPS=1000 CODE=/root/eagle3/code-s42 ./arm.sh wd05 --weight-decay 0.5   # started
#   SESSION=42 STEPS=1000 CODE=/root/eagle3/code-s42 ./arm.sh muonlr5 --muon-lr 5e-3   # in s42
# (both lost with the disk at step ~500; session 43 rebuilds the data: results/levers-s42/data.sh)
# Resumable: rerun the same command (it adds --resume where the run has checkpoints).
name=$1; shift
S=${SESSION:-41}; out=/root/eagle3/runs/s$S-$name; mkdir -p /root/eagle3/b$S
cd ${CODE:-/root/eagle3/code-s41b}
extra=""; ls $out/checkpoints/step-* > /dev/null 2>&1 && extra="--resume"
echo "start $name $(date -u +%T)"
OMP_NUM_THREADS=1 python train.py --data /root/eagle3/data/s3738 --out $out --offline \
  --ttt-length 3 --optimizer muon --lr 3e-3 --batch-size 2 --ttt-decay 0.5 --lm-head-init target \
  --draft-config results/levers-s33/e31.json --warmup 0.03 --max-steps ${STEPS:-1000} --weight-decay 0.3 \
  --eval-fraction 0.05 --eval-every 250 --save-every 50 --keep 2 --threads 1 --seed 0 \
  --no-progress "$@" $extra >> /root/eagle3/b$S/$name.log 2>&1
echo "done $name $(date -u +%T)"
