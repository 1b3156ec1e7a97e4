"""
Session 36, the "sample selection" lever of issue 23: keep half of a generate.py data set, chosen
by the target's flatness (SFDD, "Flatter Tokens are More Valuable for Speculative Draft Model
Training", arXiv 2601.18902) or at random, and train on that half for the same tokens.

The flatness of one row is how far the target's next-token distribution p (softmax of its
lm_head over the full vocabulary V, read from the stored final hidden state) is from uniform u:

    score = 1 - cos(p, u) = 1 - sum(p) / (sqrt(V) |p|_2) = 1 - 1 / (sqrt(V) |p|_2)

(u = 1/V everywhere, |u|_2 = 1/sqrt(V), sum(p) = 1). A flat p has a small |p|_2, so a small score;
a one-hot p scores 1 - 1/sqrt(V). A sequence's score is the mean over its loss rows (the rows the
TTT loss reads); the paper keeps the flattest share (smallest mean), we do the same per sequence.

Usage (from the repository root; writes a complete data directory that train.py reads as is: the
chosen sequences in their original order, their hidden states copied into new shards, the same
draft vocabulary):
    python results/levers-s36/subset.py --data /root/eagle3/data/s4243 \
        --out /root/eagle3/data/s4243-flat50 --keep 0.5 --by flatness
    python results/levers-s36/subset.py ... --out .../s4243-rand50 --keep 0.5 --by random
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from common import atomic_write, atomic_write_text, load_target_heads, run_main  # noqa: E402
from dataset import load_dataset_dir  # noqa: E402
from hidden import hidden_states_for  # noqa: E402


@torch.no_grad()
def row_flatness(final, lm_w, chunk=2048):
    """(flatness [T], target argmax [T]) of final [T, Ht]: 1 - 1/(sqrt(V) |p|_2) per row, p =
    softmax(final @ lm_w.T) over the full vocabulary; chunked, so no [T, V] tensor is kept."""
    V, s, a = lm_w.shape[0], [], []
    for i in range(0, final.shape[0], chunk):
        p = torch.softmax(final[i:i + chunk].float() @ lm_w.T, -1)
        s.append(1 - 1 / (math.sqrt(V) * p.norm(dim=-1)))
        a.append(p.argmax(-1))
    return torch.cat(s), torch.cat(a)


def flatness(final, mask, lm_w):
    """A sequence's score: the mean row flatness over its loss rows (mask)."""
    m = torch.tensor(mask, dtype=torch.bool)
    return row_flatness(final[m], lm_w)[0].mean().item() if m.any() else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep", type=float, default=0.5, help="share of the sequences kept")
    ap.add_argument("--by", choices=["flatness", "random"], required=True)
    ap.add_argument("--seed", type=int, default=0, help="--by random's permutation")
    ap.add_argument("--shard-size", type=int, default=64)
    a = ap.parse_args()
    manifest, seqs, _ = load_dataset_dir(a.data)
    n = len(seqs)
    k = max(1, round(a.keep * n))
    scores = None
    if a.by == "flatness":
        from tqdm import tqdm
        heads, _ = load_target_heads(manifest["target"])
        lm_w = heads.get_output_embeddings().weight.float()
        scores = [flatness(hidden_states_for(a.data, manifest, i)[1], s["loss_mask"], lm_w)
                  for i, s in enumerate(tqdm(seqs, desc="flatness", unit="seq"))]
        order = sorted(range(n), key=lambda i: scores[i])          # flattest first
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(a.seed)).tolist()
    keep = sorted(order[:k])

    # the new directory: sequences / conversations in their original order, new shards
    from safetensors.torch import save_file
    os.makedirs(os.path.join(a.out, "hidden"), exist_ok=True)
    sub = [seqs[i] for i in keep]
    shards = []
    for j, start in enumerate(range(0, k, a.shard_size)):
        end = min(start + a.shard_size, k)
        name = f"hidden/shard-{j:05d}.safetensors"
        t = {}
        for new, old in zip(range(start, end), keep[start:end]):
            aux, fin = hidden_states_for(a.data, manifest, old)
            t[f"aux.{new}"], t[f"final.{new}"] = aux.contiguous(), fin.contiguous()
        atomic_write(os.path.join(a.out, name), lambda tmp: save_file(t, tmp))
        shards.append({"file": name, "start": start, "end": end})
    atomic_write_text(os.path.join(a.out, "sequences.jsonl"),
                      "".join(json.dumps(s) + "\n" for s in sub))
    conv = open(os.path.join(a.data, "conversations.jsonl")).read().splitlines(True)
    if len(conv) == n:
        atomic_write_text(os.path.join(a.out, "conversations.jsonl"), "".join(conv[i] for i in keep))
    shutil.copy(os.path.join(a.data, "vocab.safetensors"), os.path.join(a.out, "vocab.safetensors"))
    m = dict(manifest)
    m.update(num_conversations=k, num_sequences=k,
             num_tokens=sum(len(s["input_ids"]) for s in sub),
             num_loss_tokens=sum(sum(s["loss_mask"]) for s in sub),
             hidden=dict(manifest["hidden"], shards=shards),
             selection={"from": os.path.abspath(a.data), "by": a.by, "keep": a.keep,
                        "seed": a.seed, "ids": keep})
    if scores is not None:
        m["selection"]["flatness"] = {"all_mean": sum(scores) / n,
                                      "kept_mean": sum(scores[i] for i in keep) / k,
                                      "kept_max": max(scores[i] for i in keep),
                                      "all_min": min(scores), "all_max": max(scores)}
        atomic_write_text(os.path.join(a.out, "flatness.json"), json.dumps(scores))
    atomic_write_text(os.path.join(a.out, "manifest.json"), json.dumps(m, indent=1))  # last: complete
    print(f"{a.out}: {k} of {n} sequences by {a.by}, {m['num_tokens']} tokens "
          f"({manifest['num_tokens']} in all), {m['num_loss_tokens']} loss tokens")
    if scores is not None:
        print(json.dumps(m["selection"]["flatness"]))


if __name__ == "__main__":
    run_main(main)
