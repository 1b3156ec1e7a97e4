"""
train.py's data: a generate.py directory checked for training, the fixed held-out split, the order
of the batches (a pure function of the step, so a resumed run continues at the exact position and
1 and N processes see the same global batches), each rank's share, and the padded batch.
"""
import functools
import math
import os

import torch

from common import UserError


# ----------------------------------------------------------------------------------------------
# Data: the generate.py directory

def read_data(path):
    """(manifest, sequences, vocab) of a generate.py directory (dataset.load_dataset_dir checks
    files and shapes), plus the checks training needs: a consistent vocab map and the manifest
    fields used below."""
    from dataset import load_dataset_dir
    if not os.path.isdir(path):
        raise UserError(f"--data {path}: no such directory")
    manifest, seqs, vocab = load_dataset_dir(path)
    need = ["target", "tokenizer_hash", "vocab_size", "draft_vocab_size", "aux_layer_ids"]
    missing = [k for k in need if k not in manifest]
    if missing:
        raise UserError(f"{path}/manifest.json: missing {', '.join(missing)}; re-run generate.py")
    V, Vd = manifest["vocab_size"], manifest["draft_vocab_size"]
    ids = vocab["draft_ids"].long()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids.clamp(0, V - 1)] = True
    ok = (bool((ids[1:] > ids[:-1]).all()) and int(ids.min()) >= 0 and int(ids.max()) < V
          and torch.equal(vocab["d2t"].long(), ids - torch.arange(Vd))
          and torch.equal(vocab["t2d"].bool(), t2d))
    if not ok:
        raise UserError(f"{path}/vocab.safetensors: draft_ids/d2t/t2d are not one consistent "
                        f"vocab map (sorted ids, d2t = id - index, t2d = membership)")
    vocab["draft_ids"] = ids
    return manifest, seqs, vocab


def check_data(manifest, seqs, target, tok, target_name, data_path, max_positions,
               what="max_position_embeddings"):
    """The data set must come from this target and tokenizer and fit the draft."""
    tcfg = getattr(target.config, "text_config", target.config)
    if manifest["vocab_size"] != tcfg.vocab_size:
        raise UserError(f"--data {data_path} was made for a vocabulary of {manifest['vocab_size']} "
                        f"tokens; target {target_name} has {tcfg.vocab_size}")
    from dataset import tokenizer_hash
    h = tokenizer_hash(tok)
    if manifest["tokenizer_hash"] != h:
        raise UserError(f"--data {data_path} was tokenized by another tokenizer "
                        f"(hash {str(manifest['tokenizer_hash'])[:12]}, target {target_name}'s "
                        f"is {h[:12]}); regenerate it for this target")
    if not seqs:
        raise UserError(f"--data {data_path}: sequences.jsonl holds no sequences")
    if sum(sum(s["loss_mask"]) for s in seqs) == 0:
        raise UserError(f"--data {data_path}: no sequence has a loss token (assistant text)")
    for n, s in enumerate(seqs):
        if len(s["input_ids"]) > max_positions:
            raise UserError(f"--data {data_path}: sequence {n} has {len(s['input_ids'])} tokens, more "
                            f"than the draft's {what} {max_positions}")
        if s["input_ids"] and not 0 <= min(s["input_ids"]) <= max(s["input_ids"]) < tcfg.vocab_size:
            raise UserError(f"--data {data_path}: sequence {n} has token ids outside the target "
                            f"vocabulary of {tcfg.vocab_size}")


def split_data(n, eval_fraction, seed):
    """A fixed held-out split: a seeded permutation, the first ones held out. It does not depend
    on the number of processes, so 1 and N processes train on the same sequences."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = 0 if eval_fraction == 0 or n < 2 else max(1, round(n * eval_fraction))
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def eval_batches_for(eval_ids, rank, world, per_rank):
    """This rank's eval batches as (sequence ids, how many are real). Every rank must run the same
    number of forwards (each one gathers FSDP shards), so short ranks repeat a sequence whose rows
    are then masked out of every sum."""
    mine = eval_ids[rank::world]
    n_batches = math.ceil(math.ceil(len(eval_ids) / world) / per_rank) if eval_ids else 0
    out = []
    for i in range(n_batches):
        real = mine[i * per_rank:(i + 1) * per_rank]
        out.append((real + [eval_ids[0]] * (per_rank - len(real)), len(real)))
    return out


def batch_indices(train_ids, step, batch_size, seed, lengths=None):
    """Global batch `step`: one seeded shuffle per epoch, the last partial batch dropped. A pure
    function of the step, so the data position of a resumed run is exact. With `lengths` (the
    token count of every sequence) batches are length-grouped (epoch_batches)."""
    per_epoch = len(train_ids) // batch_size
    epoch, i = divmod(step, per_epoch)
    lens = None if lengths is None else tuple(lengths[k] for k in train_ids)
    batch = epoch_batches(len(train_ids), batch_size, seed, epoch, lens)[i]
    return [train_ids[k] for k in batch], {"epoch": epoch, "batch_in_epoch": i}


@functools.lru_cache(maxsize=4)
def epoch_batches(n, batch_size, seed, epoch, lens=None, window=32):
    """One epoch's batches (positions into the training ids). Plain: a seeded shuffle cut into
    batches. Length-grouped: the shuffle is cut into windows of `window` batches, each window
    sorted by length and cut into batches, and the batches shuffled again, so a batch holds
    sequences of similar length (padded rows, measured on the README's full-run data at batch 8:
    19.7% random, 1.4% grouped) while the order stays random at the scale of a window."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()[:n // batch_size * batch_size]
    if lens is not None:
        w = window * batch_size
        perm = [k for c in range(0, len(perm), w) for k in sorted(perm[c:c + w], key=lens.__getitem__)]
    batches = [perm[b:b + batch_size] for b in range(0, len(perm), batch_size)]
    if lens is not None:
        batches = [batches[b] for b in torch.randperm(len(batches), generator=g).tolist()]
    return batches


def rank_share(idx, rank, world):
    """Contiguous slice of a global batch for this rank."""
    b = len(idx) // world
    return idx[rank * b:(rank + 1) * b]


# ----------------------------------------------------------------------------------------------
# Batches

def collate(seqs, idx, hidden, device):
    """Right-padded batch. Padding has loss mask 0, and causal attention keeps real rows from
    ever seeing padded ones, so padding changes no real row."""
    T = max(len(seqs[k]["input_ids"]) for k in idx)
    B = len(idx)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    A, Ht = hidden[0][0].shape[1], hidden[0][1].shape[1]
    aux = torch.zeros(B, T, A)
    final = torch.zeros(B, T, Ht)
    for b, (k, (a, f)) in enumerate(zip(idx, hidden)):
        n = len(seqs[k]["input_ids"])
        if a.shape[0] != n or f.shape[0] != n:
            raise UserError(f"hidden states of sequence {k} cover {a.shape[0]} positions, "
                            f"the sequence has {n} tokens")
        ids[b, :n] = torch.tensor(seqs[k]["input_ids"])
        mask[b, :n] = torch.tensor(seqs[k]["loss_mask"], dtype=torch.bool)
        aux[b, :n] = a.float()
        final[b, :n] = f.float()
    return ids.to(device), mask.to(device), aux.to(device), final.to(device)


def loss_positions(mask, lengths, which):
    """The positions the TTT loss reads (train.py --loss-positions): `assistant`, the loss mask
    [B, T] as it is; `all`, every real token of each sequence (its first lengths[b] positions),
    padding never."""
    if which == "assistant":
        return mask
    n = torch.tensor(lengths, device=mask.device)
    return torch.arange(mask.shape[1], device=mask.device)[None] < n[:, None]
