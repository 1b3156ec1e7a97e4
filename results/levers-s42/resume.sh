#!/bin/bash
# Session 42's two optimizer arms (weight decay 0.5, Muon lr 5e-3) lost with the disk at step ~500,
# redone from nothing with the base beside them (the data is regenerated and the CPU is another, so
# session 41's base is not reused): data first (data.sh), then the three arms of
# results/levers-s41/arm.sh side by side, one thread each. Resumable end to end: rerun it (data.sh
# skips what is done, arm.sh adds --resume; checkpoints every 50 steps), then MT-Bench 40 x 2 (chain
# 1,3,1,4 and tree 1,5,4,8, 64 tokens, fp32) of each arm's last checkpoint, one thread each.
#   cd /root/eagle3/code-s43 && nohup results/levers-s42/resume.sh > /root/eagle3/resume43.log 2>&1 &
# where /root/eagle3/code-s43 is `git archive` of a commit that has this file (session 43: 567930b's
# code with this file, data.sh and arm.sh copied in; a later commit trains the same unless train.py,
# ttt.py or optim.py changed).
set -e
cd "$(dirname "$0")/../.."
results/levers-s42/data.sh
export SESSION=43 STEPS=1000 CODE=$PWD
results/levers-s41/arm.sh base &
results/levers-s41/arm.sh wd05 --weight-decay 0.5 &
results/levers-s41/arm.sh muonlr5 --muon-lr 5e-3 &
wait
B=/root/eagle3/b43; R=/root/eagle3/runs
bench() {
  [ -f $B/bench_$1.json ] && return
  OMP_NUM_THREADS=1 python bench.py --draft $R/s43-$1/checkpoints/step-001000 \
    --benchmark-list mtbench:40 --config-list 1,3,1,4 1,5,4,8 --no-peers --max-new-tokens 64 \
    --dtype float32 --output $B/bench_$1.json > $B/bench_$1.log 2>&1
}
bench base & bench wd05 & bench muonlr5 & wait
echo "done $(date -u +%T)"
