"""How many of speculators' packed batches (its own MultipackDistributedBatchSamplerV2, as
train/dataloader.py builds it for the training split) hold a token budget: JSON in, JSON out."""
import json
import sys

from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

p = json.loads(sys.argv[1])
lengths = p["lengths"]
s = MultipackDistributedBatchSamplerV2(batch_max_length=p["total_seq_len"], lengths=lengths,
                                       num_replicas=1, rank=0, seed=p["seed"])
steps = tokens = epoch = 0
per_epoch = []
while tokens < p["tokens"]:
    s.set_epoch(epoch)
    batches = list(iter(s))
    per_epoch.append(len(batches))
    for b in batches:
        tokens += sum(min(lengths[i], p["total_seq_len"]) for i in b)
        steps += 1
        if tokens >= p["tokens"]:
            break
    epoch += 1
print(json.dumps({"steps": steps, "epochs": epoch, "tokens": tokens,
                  "batches_per_epoch": per_epoch[0], "total_seq_len": p["total_seq_len"]}))
