"""
Step 1 of results/peer_speculators.py: a generate.py directory in speculators 0.9.0's offline
format (its module docstring says which files and why), and how this project's python runs a
helper in the speculators venv (results/speculators_venv/, shared with step 2). The Arrow set is
written by the venv (spec_arrow.py).
"""
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import UserError  # noqa: E402

SPEC_DATA = "spec-data"
SHIM_DIR = os.path.join(ROOT, "results", "speculators_venv")


def say(stage, msg):
    print(f"[{stage}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# What runs in the speculators virtualenv: results/speculators_venv/ (cpu_shim.py, spec_train.py,
# spec_arrow.py, spec_plan.py), plain files that import nothing of this project

def venv_env(threads):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), COLUMNS="160", TERM="dumb", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)     # nothing of this project in the venv, nothing of it here
    return env


def run_venv(args, script, argv, what, log=None):
    """Run a helper in the speculators venv; its last stdout line is JSON. One-line error."""
    cmd = [args.spec_python, os.path.join(SHIM_DIR, script)] + argv
    p = subprocess.run(cmd, capture_output=True, text=True, env=venv_env(args.threads),
                       cwd=args.work)
    if log:
        with open(log, "w") as f:
            f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"--spec-python {args.spec_python}: {what} failed (rc {p.returncode}): "
                        f"{last[:300]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# Step 1: the data, in speculators' offline format

def prenorm_states(target, seqs, layer_ids, batch_size):
    """For each token-id list: (aux [T, n*Ht] = outputs of decoder layers `layer_ids`, pre [T, Ht]
    = the last decoder layer's output before the final norm, post [T, Ht] = transformers'
    hidden_states[-1]), in the target's dtype on CPU, plus whether norm(pre) == post held exactly
    on every batch (it says hidden_states[-1] is after the norm, so `pre` is the state before it).
    Batched longest first with right padding, as hidden.target_hidden_states."""
    import torch
    decoder = target.base_model
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise UserError(f"--target: {type(decoder).__name__} has no final norm module `norm`; "
                        f"cannot capture the state before it")
    got = {}
    hook = norm.register_forward_pre_hook(lambda m, a: got.__setitem__("pre", a[0]))
    dev = next(target.parameters()).device
    order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k]))
    out, exact = [None] * len(seqs), True
    try:
        with torch.inference_mode():
            for s in range(0, len(order), batch_size):
                idx = order[s:s + batch_size]
                lens = [len(seqs[k]) for k in idx]
                T = max(lens)
                ids = torch.zeros((len(idx), T), dtype=torch.long)
                mask = torch.zeros((len(idx), T), dtype=torch.long)
                for r, k in enumerate(idx):
                    ids[r, :lens[r]] = torch.as_tensor(seqs[k])
                    mask[r, :lens[r]] = 1
                got.clear()
                res = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                              output_hidden_states=True, use_cache=False)
                hs = res.hidden_states
                if "pre" not in got:
                    raise UserError("--target: the final norm was never called in a forward")
                pre, post = got.pop("pre"), hs[-1]
                exact &= bool(torch.equal(norm(pre), post)) and not bool(torch.equal(pre, post))
                aux = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
                for r, k in enumerate(idx):
                    n = lens[r]
                    out[k] = (aux[r, :n].cpu().clone(), pre[r, :n].cpu().clone(),
                              post[r, :n].cpu().clone())
    finally:
        hook.remove()
    return out, exact


def rel_err(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def data_key(args, manifest):
    st = os.stat(os.path.join(args.data, "manifest.json"))
    return {"data": os.path.abspath(args.data), "manifest_mtime": st.st_mtime,
            "num_sequences": manifest["num_sequences"], "eval_fraction": args.eval_fraction,
            "seed": args.seed, "hs_dtype": args.hs_dtype, "target_dtype": args.target_dtype,
            "aux_from": args.aux_from, "loss_mask": args.loss_mask, "target": args.target_path}


def convert(args):
    """generate.py directory -> W/spec-data (module docstring, step 1). Returns the record."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from common import load_target, parse_dtype
    from hidden import hidden_states_for
    from train_data import read_data, split_data
    t0 = time.time()
    manifest, seqs, vocab = read_data(args.data)
    rec_path = os.path.join(args.work, "convert.json")
    key = data_key(args, manifest)
    out = os.path.join(args.work, SPEC_DATA)
    if not args.force and os.path.exists(rec_path):
        with open(rec_path) as f:
            rec = json.load(f)
        if rec.get("key") == key and os.path.isdir(os.path.join(out, "hidden_states")):
            say("convert", f"reusing {out} (same data and settings; --force redoes it)")
            return rec
    ids_ours = list(manifest["aux_layer_ids"])
    train_ids, eval_ids = split_data(len(seqs), args.eval_fraction, args.seed)
    if not eval_ids:
        raise UserError(f"--eval-fraction {args.eval_fraction}: speculators' trainer needs a "
                        f"validation split (train_data_ratio < 1); use > 0")
    rows = train_ids + eval_ids
    n, n_train = len(rows), len(train_ids)
    ratio = (n_train + 0.5) / n
    assert int(n * ratio) == n_train, (n, n_train, ratio)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(args.work, "src"), exist_ok=True)
    shift = args.loss_mask == "train-py"
    rows_path = os.path.join(args.work, "src", "rows.jsonl")
    with open(rows_path, "w") as f:
        for k in rows:
            s = seqs[k]
            m = [int(x) for x in s["loss_mask"]]
            if shift:   # speculators counts row r if x[r+1] is masked; train.py if x[r+2] is
                m = m[1:] + [0]
            f.write(json.dumps({"input_ids": s["input_ids"], "loss_mask": m,
                                "seq_len": len(s["input_ids"])}) + "\n")
    say("convert", f"{n} sequences ({n_train} train.py training sequences first, {n - n_train} "
                   f"held out last; --train-data-ratio {ratio:.6f}); writing the Arrow data set")
    arrow = run_venv(args, "spec_arrow.py", [rows_path, out], "writing the Arrow data set")

    # the hidden states: the shards' aux (what train.py --offline reads) or the target's, and
    # the pre-norm final state, always from the target
    has_shards = bool((manifest.get("hidden") or {}).get("shards"))
    aux_from = args.aux_from if args.aux_from != "auto" else ("shards" if has_shards else "target")
    if aux_from == "shards" and not has_shards:
        raise UserError(f"--aux-from shards: {args.data} has no hidden-state shards "
                        f"(generate.py --hidden-states)")
    say("convert", f"loading target {args.target_path} ({args.target_dtype}) for the final "
                   f"pre-norm states; captured layers from the {aux_from}")
    target, _ = load_target(args.target_path, args.target_dtype)
    hd = parse_dtype(args.hs_dtype)
    hdir = os.path.join(out, "hidden_states")
    os.makedirs(hdir)
    exact_all, worst_aux, worst_final, done, tok = True, 0.0, 0.0, 0, 0
    chunk = max(args.target_batch_size * 8, 64)
    for c in range(0, n, chunk):
        part = rows[c:c + chunk]
        res, exact = prenorm_states(target, [seqs[k]["input_ids"] for k in part], ids_ours,
                                    args.target_batch_size)
        exact_all &= exact
        for j, (k, (aux, pre, post)) in enumerate(zip(part, res)):
            if has_shards:
                s_aux, s_final = hidden_states_for(args.data, manifest, k)
                if s_aux.shape != aux.shape or s_final.shape != post.shape:
                    raise UserError(f"{args.data}: shard of sequence {k} holds aux "
                                    f"{list(s_aux.shape)} / final {list(s_final.shape)}, the "
                                    f"target gives {list(aux.shape)} / {list(post.shape)}")
                worst_aux = max(worst_aux, rel_err(s_aux, aux))
                worst_final = max(worst_final, rel_err(s_final, post))
                if aux_from == "shards":
                    aux = s_aux
            T, H = pre.shape
            hs = torch.cat([aux.to(hd).reshape(T, len(ids_ours), H), pre.to(hd).unsqueeze(1)], 1)
            save_file({"hidden_states": hs.contiguous(),
                       "token_ids": torch.as_tensor(seqs[k]["input_ids"], dtype=torch.long)},
                      os.path.join(hdir, f"hs_{c + j}.safetensors"))
            tok += T
        done += len(part)
        say("convert", f"hidden states {done}/{n} sequences ({tok:,} tokens)")
    del target
    if not exact_all:
        raise UserError(f"--target {args.target_path}: norm(state before the final norm) is not "
                        f"transformers' hidden_states[-1] here; the 'final before norm' state "
                        f"cannot be told apart, nothing written")
    # bf16 shards against an fp32 forward differ by ~2^-8 of a value; a different target or
    # different data by O(1)
    if has_shards and max(worst_aux, worst_final) > 0.1:
        raise UserError(f"{args.data}/hidden: the stored states differ from the target's by up to "
                        f"{max(worst_aux, worst_final):.3g} (relative): not this target's (or "
                        f"--target-dtype {args.target_dtype} is not the one they were made in)")
    V, Vd = manifest["vocab_size"], manifest["draft_vocab_size"]
    d2t = vocab["d2t"].long().numpy()
    t2d = vocab["t2d"].bool().numpy()
    np.save(os.path.join(out, f"d2t-{Vd}.npy"), d2t)
    np.save(os.path.join(out, f"t2d-{Vd}.npy"), t2d)
    lengths = [len(seqs[k]["input_ids"]) for k in rows]
    rec = {
        "key": key, "spec_data": out, "arrow": arrow, "num_rows": n, "train_rows": n_train,
        "val_rows": n - n_train, "train_data_ratio": ratio,
        "train_tokens": sum(lengths[:n_train]), "lengths": lengths,
        "train_ids": train_ids, "eval_ids": eval_ids,
        "loss_mask": ("assistant tokens, shifted left by one (speculators then counts the rows "
                      "train.py counts)" if shift else "assistant tokens (generate.py's mask, as "
                      "speculators' prepare_data writes it)"),
        "loss_tokens": sum(sum(seqs[k]["loss_mask"]) for k in rows),
        "hidden_states": {"shape": f"[T, {len(ids_ours) + 1}, {manifest.get('hidden_size')}]",
                          "dtype": args.hs_dtype, "aux_from": aux_from,
                          "final": "last decoder layer's output before the final norm "
                                   "(forward pre-hook on the final norm)",
                          "norm_of_pre_equals_hidden_states_minus_1_exactly": exact_all,
                          "shards_vs_target_rel_err": ({"aux": worst_aux, "final_post_norm": worst_final}
                                                       if has_shards else None)},
        "aux_layer_ids": {"this_project_output_of_layer": ids_ours,
                          "speculators_input_of_layer": [i + 1 for i in ids_ours]},
        "draft_vocab_size": Vd, "vocab_size": V,
        "vocab_files": [f"d2t-{Vd}.npy", f"t2d-{Vd}.npy"],
        "seconds": round(time.time() - t0, 1),
    }
    with open(rec_path, "w") as f:
        json.dump(rec, f, indent=1)
    say("convert", f"done in {rec['seconds']} s: {out} ({tok:,} tokens; pre-norm check exact: "
                   f"{exact_all}" + (f"; shards vs target: aux {worst_aux:.2g}, final "
                                     f"{worst_final:.2g} relative" if has_shards else "") + ")")
    return rec
