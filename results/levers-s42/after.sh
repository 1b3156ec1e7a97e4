#!/bin/bash
# Session 42: after the two arms: held-out at TTT 5 for the three drafts, then MT-Bench 40 x 2
# (chain 1,3,1,4 and tree 1,5,4,8, 64 tokens, fp32) for each, one thread each, side by side.
# The arms: results/levers-s41/arm.sh with SESSION=42 (its header has the two commands).
B=/root/eagle3/b42; R=/root/eagle3/runs
while pgrep -f "s42-ttt[45] " > /dev/null || pgrep -f "arm.sh ttt" > /dev/null; do sleep 20; done
echo "arms done $(date -u +%T)"
base=$R/s41-base/checkpoints/step-001000
t4=$(ls -d $R/s42-ttt4/checkpoints/step-* | tail -1); t5=$(ls -d $R/s42-ttt5/checkpoints/step-* | tail -1)
echo "$base $t4 $t5"
$B/heldout5.sh $base base & $B/heldout5.sh $t4 ttt4 & wait; $B/heldout5.sh $t5 ttt5
echo "held-out done $(date -u +%T)"
cd /root/eagle3/code-s42
bench() {
  [ -f $B/bench_$1.json ] && return
  OMP_NUM_THREADS=1 python bench.py --draft $2 --benchmark-list mtbench:40 --config-list 1,3,1,4 \
    1,5,4,8 --no-peers --max-new-tokens 64 --dtype float32 --output $B/bench_$1.json > $B/bench_$1.log 2>&1
}
bench base $base & bench ttt5 $t5 & bench ttt4 $t4 & wait
echo "bench done $(date -u +%T)"
