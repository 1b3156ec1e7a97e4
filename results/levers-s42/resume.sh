#!/bin/bash
# Session 42's two optimizer arms (weight decay 0.5, Muon lr 5e-3) lost with the disk at step ~500,
# redone from nothing with the base beside them (the data is regenerated and the CPU is another, so
# session 41's base is not reused): data first (data.sh), then the three arms of
# results/levers-s41/arm.sh side by side, one thread each. Resumable end to end: rerun it (data.sh
# skips what is done, arm.sh adds --resume; checkpoints every 50 steps).
#   cd /root/eagle3/code-s43 && nohup results/levers-s42/resume.sh > /root/eagle3/resume43.log 2>&1 &
# where /root/eagle3/code-s43 is `git archive` of a commit that has this file (session 43: 4c12708's
# code; any later commit trains the same unless train.py / ttt.py / optim.py changed).
set -e
cd "$(dirname "$0")/../.."
results/levers-s42/data.sh
export SESSION=43 STEPS=1000 CODE=$PWD
results/levers-s41/arm.sh base &
results/levers-s41/arm.sh wd05 --weight-decay 0.5 &
results/levers-s41/arm.sh muonlr5 --muon-lr 5e-3 &
wait
