#!/bin/bash
# The data of sessions 30-33's levers, rebuilt from nothing on any machine (sessions 32 -> 33 lost
# the disk): run from the repository root; DATA defaults to /root/eagle3/data (outside the work
# tree). Resumable: rerun it; generate.py continues a conversations.jsonl, finished steps are skipped.
#   s42, s43  512 synthesised prompts each (seeds 42, 43), answers regenerated greedily by the
#             default target in fp32, one process per core;  s4243 = both, with hidden states
#   h41       100 conversations (seed 41) with fp32 hidden states: the fixed held-out set no draft
#             has seen (train.py --eval-fraction 0.9 replays 90 of them)
# Session 33 (2-core AMD EPYC with AVX-512, fp32): synthesis 4.5 min, regeneration 41 min (4.8 s a
# conversation per core), h41 8 min, s4243 states 13 min (480 tok/s); token counts equal to the
# token to sessions 27-31's on the AVX2 EPYC: s42 192,383, s43 188,598, h41 36,738.
set -e
D=${DATA:-/root/eagle3/data}; V=drafts/smollm2-135m-eagle31-3k; mkdir -p $D
G="--temperature 0 --vocab-from $V --max-length 1024 --max-new-tokens 192 \
   --synth-max-new-tokens 48 --batch-size 64 --synth-batch-size 64 --followups 1 --dtype float32"
if [ ! -f $D/s4243.jsonl ]; then
  OMP_NUM_THREADS=1 python generate.py --synthesize 512 --seed 42 --out $D/s42 $G > $D/s42.log 2>&1 &
  OMP_NUM_THREADS=1 python generate.py --synthesize 512 --seed 43 --out $D/s43 $G > $D/s43.log 2>&1 &
  wait
  cat $D/s42/conversations.jsonl $D/s43/conversations.jsonl > $D/s4243.jsonl.tmp
  mv $D/s4243.jsonl.tmp $D/s4243.jsonl
fi
if [ ! -f $D/h41.done ]; then
  OMP_NUM_THREADS=2 python generate.py --synthesize 100 --seed 41 --out $D/h41 --temperature 0 \
    --vocab-from $V --max-length 1024 --max-new-tokens 192 --synth-max-new-tokens 48 \
    --batch-size 25 --synth-batch-size 50 --followups 1 --hidden-states --hidden-dtype float32 \
    --dtype float32 > $D/h41.log 2>&1
  touch $D/h41.done
fi
if [ ! -f $D/s4243.done ]; then
  OMP_NUM_THREADS=2 python generate.py --prompts $D/s4243.jsonl --no-regenerate --out $D/s4243 \
    --vocab-from $V --max-length 1024 --hidden-states --batch-size 16 --dtype float32 > $D/s4243.log 2>&1
  touch $D/s4243.done
fi
wc -l $D/s42/conversations.jsonl $D/s43/conversations.jsonl $D/h41/conversations.jsonl
