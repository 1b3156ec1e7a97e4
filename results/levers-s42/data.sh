#!/bin/bash
# s3738: the ship run's data (drafts/smollm2-135m-eagle31-3k2) and sessions 41-42's lever protocol
# (results/levers-s41/arm.sh), rebuilt from nothing on any machine (session 42 -> 43 lost the disk;
# until then the commands lived only in /root/eagle3/gen37.sh, RUNS.md *Sessions 37-38*).
# Run from the repository root (or a `git archive` of it); DATA defaults to /root/eagle3/data, outside
# the work tree. Resumable: rerun it; generate.py continues each conversations.jsonl, finished steps
# are skipped.
#   s37, s38  1,408 prompts each, synthesised by the default target (seeds 37, 38), answers
#             regenerated greedily in fp32 with one follow-up turn, one process per core
#   s3738     both, with the target's hidden states (target fp32, stored bf16)
# Session 38 on the 2-core Ice Lake: 2,816 sequences, 1,037,277 tokens (816,158 in the loss),
# 44 shards, 4.78 GB. Synthesis 18.7 min, regeneration 4.3 s a conversation per core, states ~60 min.
set -e
D=${DATA:-/root/eagle3/data}; V=drafts/smollm2-135m-eagle31-3k; mkdir -p $D
G="--temperature 0 --vocab-from $V --max-length 1024 --max-new-tokens 192 \
   --synth-max-new-tokens 48 --batch-size 64 --synth-batch-size 64 --followups 1 --dtype float32"
if [ ! -f $D/s3738.jsonl ]; then
  for s in 37 38; do
    OMP_NUM_THREADS=1 python generate.py --synthesize 1408 --seed $s --out $D/s$s $G >> $D/s$s.log 2>&1 &
  done
  wait
  n37=$(wc -l < $D/s37/conversations.jsonl); n38=$(wc -l < $D/s38/conversations.jsonl)
  [ "$n37" = 1408 ] && [ "$n38" = 1408 ] || { echo "s37/s38: $n37/$n38 of 1408 conversations" >&2; exit 1; }
  cat $D/s37/conversations.jsonl $D/s38/conversations.jsonl > $D/s3738.jsonl.tmp
  mv $D/s3738.jsonl.tmp $D/s3738.jsonl
fi
if [ ! -f $D/s3738.done ]; then
  OMP_NUM_THREADS=2 python generate.py --prompts $D/s3738.jsonl --no-regenerate --out $D/s3738 \
    --vocab-from $V --max-length 1024 --hidden-states --hidden-dtype bfloat16 --batch-size 16 \
    --dtype float32 >> $D/s3738.log 2>&1
  touch $D/s3738.done
fi
wc -l $D/s37/conversations.jsonl $D/s38/conversations.jsonl
