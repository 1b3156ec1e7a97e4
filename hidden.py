"""
The target's hidden states: what the draft reads. Computed by the target (transformers here; SGLang
in sglang_engine.py, same inputs and outputs), stored by generate.py --hidden-states in safetensors
shards, and handed to train.py either read back from those shards (--offline) or computed online by a
producer process next to the trainer.

Per sequence of T tokens: aux [T, 3*Ht] = the outputs of the three captured decoder layers (n*Ht
for a draft that reads n layers, model.py layouts),
concatenated in ascending layer order, and final [T, Ht] = the last layer's output after the final
norm, so the target's logits are lm_head(final) and never need storing.

    hidden/shard-NNNNN.safetensors   aux.{k} [T, 3*Ht] and final.{k} [T, Ht] for k in [start, end)
"""
import hashlib
import json
import os
import signal
import time

import torch

from common import UserError, atomic_write

HIDDEN_DIR = "hidden"


# ----------------------------------------------------------------------------------------------
# Computing them (transformers)


@torch.inference_mode()
def target_hidden_states(target, sequences, layer_ids, batch_size=8):
    """For each token-id list: (aux [T, 3*Ht], final [T, Ht]) on CPU in the target's dtype.

    aux concatenates the outputs of decoder layers `layer_ids` (hidden_states[i + 1]); final is the
    last entry of hidden_states, which transformers has already passed through the final norm,
    so the target's logits are target.lm_head(final). Sequences are batched longest first with
    right padding: pads come after every real token, so causal attention never lets a real token
    see one, and each result is sliced back to its true length. The decoder (target.base_model)
    is called directly, which skips the [B, T, V] logits nobody asked for."""
    from draft_config import check_aux_layers
    L = target.config.get_text_config().num_hidden_layers
    check_aux_layers(layer_ids, L, "aux layer ids")
    dev = next(target.parameters()).device
    decoder = target.base_model
    order = sorted(range(len(sequences)), key=lambda k: -len(sequences[k]))
    out = [None] * len(sequences)
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        lens = [len(sequences[k]) for k in idx]
        if min(lens) == 0:
            raise UserError("an empty token sequence has no hidden states")
        T = max(lens)
        ids = torch.zeros((len(idx), T), dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.long)
        for r, k in enumerate(idx):
            ids[r, :lens[r]] = torch.as_tensor(sequences[k], dtype=torch.long)
            mask[r, :lens[r]] = 1
        res = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                      output_hidden_states=True, use_cache=False)
        hs = res.hidden_states
        aux = torch.cat([hs[i + 1] for i in layer_ids], dim=-1).cpu()
        final = hs[-1].cpu()
        for r, k in enumerate(idx):
            out[k] = (aux[r, :lens[r]].clone(), final[r, :lens[r]].clone())
    return out


# ----------------------------------------------------------------------------------------------
# Shards: what generate.py --hidden-states writes and --offline training reads

def shard_meta(tok_hash, layer_ids, dtype, seqs, start, end, source=""):
    """What a shard was made from; a re-run recomputes any shard whose metadata differs.
    `source` names the producer (target, its dtype, backend): states from a bf16 target are not
    those of an fp32 one."""
    h = hashlib.sha256(json.dumps([s["input_ids"] for s in seqs[start:end]]).encode()).hexdigest()
    return {"tokenizer_hash": tok_hash, "aux_layer_ids": json.dumps(list(layer_ids)),
            "dtype": dtype, "start": str(start), "end": str(end), "sequences_sha256": h,
            "source": source}


def write_hidden_shards(compute, out_dir, seqs, layer_ids, tok_hash, dtype_name, shard_size,
                        source=""):
    """Write hidden/shard-NNNNN.safetensors for every `shard_size` sequences; finished shards
    (matching metadata) are skipped. compute(list of id lists) -> [(aux, final)]."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm
    from common import parse_dtype
    dtype = parse_dtype(dtype_name)
    hdir = os.path.join(out_dir, HIDDEN_DIR)
    os.makedirs(hdir, exist_ok=True)
    shards, todo = [], 0
    plan = []
    for i, start in enumerate(range(0, len(seqs), shard_size)):
        end = min(start + shard_size, len(seqs))
        name = f"{HIDDEN_DIR}/shard-{i:05d}.safetensors"
        meta = shard_meta(tok_hash, layer_ids, dtype_name, seqs, start, end, source)
        shards.append({"file": name, "start": start, "end": end})
        path = os.path.join(out_dir, name)
        ok = False
        if os.path.exists(path):
            try:
                with safe_open(path, "pt") as f:
                    ok = f.metadata() == meta
            except Exception:
                ok = False  # unreadable: recompute it
        if not ok:
            plan.append((path, meta, start, end))
            todo += sum(len(s["input_ids"]) for s in seqs[start:end])
    # shards left over from an earlier run with more sequences are not part of this data set
    keep = {os.path.basename(sh["file"]) for sh in shards}
    for name in os.listdir(hdir):
        if name.startswith("shard-") and name.endswith(".safetensors") and name not in keep:
            os.remove(os.path.join(hdir, name))
    if not plan:
        return shards, None
    bar = tqdm(total=todo, desc="hidden states", unit="tok")
    t0 = time.time()
    for path, meta, start, end in plan:
        res = compute([s["input_ids"] for s in seqs[start:end]])
        tensors = {}
        for k, (aux, final) in zip(range(start, end), res):
            tensors[f"aux.{k}"] = aux.to(dtype).contiguous()
            tensors[f"final.{k}"] = final.to(dtype).contiguous()
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
        bar.update(sum(len(s["input_ids"]) for s in seqs[start:end]))
    bar.close()
    return shards, todo / max(time.time() - t0, 1e-9)


def read_hidden_shard(path, k):
    """(aux [T, 3*Ht], final [T, Ht]) of sequence k from the shard file that holds it."""
    from safetensors import safe_open
    try:
        with safe_open(path, "pt") as f:
            return f.get_tensor(f"aux.{k}"), f.get_tensor(f"final.{k}")
    except FileNotFoundError:
        raise UserError(f"{path}: hidden-state shard missing; re-run generate.py --hidden-states")
    except Exception as e:
        raise UserError(f"{path}: cannot read sequence {k} ({str(e).splitlines()[0]}); "
                        f"re-run generate.py --hidden-states to rewrite it")


def hidden_states_for(data_dir, manifest, k):
    """(aux, final) of sequence k of a dataset directory, finding its shard in the manifest."""
    hidden = manifest.get("hidden")
    if not hidden:
        raise UserError(f"{data_dir}: has no hidden states; re-run generate.py with --hidden-states")
    for sh in hidden["shards"]:
        if sh["start"] <= k < sh["end"]:
            return read_hidden_shard(os.path.join(data_dir, sh["file"]), k)
    raise UserError(f"{data_dir}: no shard holds sequence {k}")


# ----------------------------------------------------------------------------------------------
# To the trainer: read back from the shards, or computed online by a producer process

def check_offline(data_path, manifest):
    hidden = manifest.get("hidden")
    if not hidden or not hidden.get("shards"):
        raise UserError(f"--data {data_path} has no stored hidden states (manifest hidden is "
                        f"null): drop --offline to compute them online, or run generate.py "
                        f"--hidden-states")


class Offline:
    """Hidden states read from generate.py's shards (aux.{k}, final.{k} of sequence k)."""

    def __init__(self, data_path, manifest):
        check_offline(data_path, manifest)
        self.path, self.manifest, self.wait = data_path, manifest, 0.0

    def get_ids(self, idx):
        t0 = time.perf_counter()
        out = [hidden_states_for(self.path, self.manifest, k) for k in idx]
        self.wait += time.perf_counter() - t0
        return out

    def close(self):
        pass


def exit_with_parent():
    """A trainer killed by SIGKILL cannot end its producer, which would then block forever on a
    full queue (or on `release`) holding the target in memory. So the producer watches for the
    moment it is re-parented (its parent died) and exits."""
    import threading
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def producer_main(q, release, target_name, target_dtype, device, seqs, jobs, layer_ids,
                  batch_size, threads, hidden_dtype, trust_remote_code=False,
                  backend="transformers"):
    """Runs in its own process: for each job (key, sequence ids) compute the target's hidden
    states and put (key, [(aux, final), ...]) in the queue. put() blocks when the queue is full,
    so the producer runs at most `prefetch` batches ahead of the trainer. The target runs in
    transformers or in SGLang's ModelRunner (sglang_engine.py): same jobs, same order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and ends us
    exit_with_parent()
    try:
        torch.set_num_threads(threads)
        from common import load_target, parse_dtype, resolve_target
        if backend == "sglang":
            import sglang_engine  # every SGLang call lives there
            longest = max((len(seqs[k]) for _, idx in jobs for k in idx), default=1)
            runner = sglang_engine.runner(resolve_target(target_name), target_dtype,
                                          max_total_tokens=batch_size * longest + 256,
                                          gpu_id=torch.device(device).index or 0,
                                          trust_remote_code=trust_remote_code)

            def compute(seqs):
                return sglang_engine.hidden_states(runner, seqs, layer_ids, batch_size)
        else:
            target, _ = load_target(target_name, target_dtype, device, trust_remote_code)

            def compute(seqs):
                return target_hidden_states(target, seqs, layer_ids, batch_size)
        hd = parse_dtype(hidden_dtype)
        for key, idx in jobs:
            with torch.inference_mode():
                hs = compute([seqs[k] for k in idx])
            q.put((key, [(a.to("cpu", hd).clone(), f.to("cpu", hd).clone()) for a, f in hs]))
        q.put(("done", None))
        # Tensors travel as shared-memory handles owned by this process: it must outlive the
        # trainer's last get(), so it waits to be released instead of exiting.
        release.wait()
    except UserError as e:
        q.put(("error", str(e)))
    except Exception as e:
        import traceback
        q.put(("error", f"target producer failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Online:
    """Trainer side of the producer: get() returns the hidden states of the next job, timing the
    wait so the log can say whether the producer keeps up."""

    def __init__(self, args, seqs, jobs, layer_ids):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue(maxsize=args.prefetch)
        self.release = ctx.Event()
        ids = [s["input_ids"] for s in seqs]
        self.proc = ctx.Process(target=producer_main, daemon=True, args=(
            self.q, self.release, args.target, args.target_dtype, args.device, ids, jobs, layer_ids,
            args.producer_batch_size, args.producer_threads, args.hidden_dtype,
            args.trust_remote_code, args.target_backend))
        self.proc.start()
        self.wait = 0.0

    def get(self, key):
        import queue
        t0 = time.perf_counter()
        while True:
            try:
                got, item = self.q.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise UserError("the target producer process died (out of memory?)")
            except (ConnectionError, EOFError):
                # the item's tensors live in the producer's shared memory, fetched from it on
                # unpickling: a producer that died after queueing them cannot hand them over
                raise UserError("the target producer process died (out of memory?) while "
                                "handing over hidden states")
        self.wait += time.perf_counter() - t0
        if got == "error":
            raise UserError(item)
        assert got == key, (got, key)  # the producer follows the same job list in order
        return item

    def close(self):
        self.release.set()
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10)
