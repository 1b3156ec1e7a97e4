"""
The data directory generate.py writes and train.py reads: file names, the manifest, the checks on
load, and the write helpers that make every step resumable.

    manifest.json          target, tokenizer hash, counts, aux layer ids, shard list, "complete"
    synth_prompts.jsonl    (--synthesize) the target's own prompts, appended as they come
    conversations.jsonl    {"messages": [...]} per line, the regenerated conversations, appended
    sequences.jsonl        {"input_ids", "loss_mask", "conversation": k[, "turn": i]} per line
    vocab.safetensors      draft_ids [Vd], d2t [Vd], t2d bool [V], counts [V]
    hidden/shard-NNNNN.safetensors   aux.{k} [T, 3*Ht] and final.{k} [T, Ht] (hidden.py)

Logs (synth_prompts, conversations) are appended one whole line at a time and a torn last line is
cut off on resume; every other file is written to a temporary name and renamed. The manifest says
"complete" only once everything else is in place, so a killed run never looks finished.
"""
import hashlib
import json
import os

from common import UserError, atomic_write_text, read_json

MANIFEST = "manifest.json"
CONVERSATIONS = "conversations.jsonl"
SEQUENCES = "sequences.jsonl"
VOCAB = "vocab.safetensors"
SYNTH_PROMPTS = "synth_prompts.jsonl"
FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------
# Small file helpers: every file is written to a temp name and renamed, so a crash never leaves
# a file that looks finished; JSONL logs are appended one whole line at a time.

def atomic_write_jsonl(path, rows):
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def append_lines(f, rows):
    """Append whole lines in one write and flush them to disk before moving on."""
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    f.flush()
    os.fsync(f.fileno())


def read_log(path):
    """Rows of a JSONL log we append to. A torn last line (killed mid-write) is cut off."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    keep = data.rfind(b"\n") + 1  # everything after the last newline is a torn line
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    rows = []
    for n, line in enumerate(data[:keep].decode("utf-8").splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: corrupt line ({e.msg}); delete the file to redo this step")
    return rows


# ----------------------------------------------------------------------------------------------
# The tokenizer's fingerprint, loading a finished directory, reusing an existing one


def tokenizer_hash(tok):
    """sha256 of the vocabulary (sorted token -> id) and the chat template: two data sets with
    the same hash tokenize and render alike."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update((getattr(tok, "chat_template", None) or "").encode())
    return h.hexdigest()


def load_dataset_dir(path):
    """(manifest, sequences, vocab) of a finished generate.py output directory."""
    from safetensors.torch import load_file
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such data directory (make one with generate.py)")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise UserError(f"{path}: no {MANIFEST}; not a generate.py output directory")
    manifest = read_json(mpath)
    if not manifest.get("complete"):
        raise UserError(f"{path}: generate.py did not finish here; re-run it to complete the data")
    spath = os.path.join(path, SEQUENCES)
    if not os.path.exists(spath):
        raise UserError(f"{path}: no {SEQUENCES}; re-run generate.py")
    sequences = []
    with open(spath) as f:
        for n, line in enumerate(f, 1):
            try:
                s = json.loads(line)
                ok = len(s["input_ids"]) == len(s["loss_mask"]) > 0
            except (json.JSONDecodeError, KeyError, TypeError):
                ok = False
            if not ok:
                raise UserError(f"{spath}:{n}: corrupt sequence line; re-run generate.py")
            sequences.append(s)
    if len(sequences) != manifest.get("num_sequences"):
        raise UserError(f"{spath}: {len(sequences)} sequences, manifest says "
                        f"{manifest.get('num_sequences')}; re-run generate.py")
    vpath = os.path.join(path, VOCAB)
    try:
        vocab = load_file(vpath)
    except FileNotFoundError:
        raise UserError(f"{path}: no {VOCAB}; re-run generate.py")
    except Exception as e:
        raise UserError(f"{vpath}: corrupt ({str(e).splitlines()[0]}); re-run generate.py")
    V, Vd = manifest.get("vocab_size"), manifest.get("draft_vocab_size")
    shapes = {"draft_ids": [Vd], "d2t": [Vd], "t2d": [V], "counts": [V]}
    for k, shape in shapes.items():
        if k not in vocab or list(vocab[k].shape) != shape:
            raise UserError(f"{vpath}: {k} missing or not of shape {shape}; re-run generate.py")
    for sh in (manifest.get("hidden") or {}).get("shards", []):
        if not os.path.exists(os.path.join(path, sh["file"])):
            raise UserError(f"{path}: hidden-state shard {sh['file']} missing; "
                            f"re-run generate.py --hidden-states")
    return manifest, sequences, vocab


def check_out_dir(out, target_name, tok_hash):
    """An existing output directory must hold data for this same target and tokenizer."""
    mpath = os.path.join(out, MANIFEST)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out}: exists and is not a directory")
    if not os.path.exists(mpath):
        if os.path.isdir(out) and os.listdir(out):
            raise UserError(f"--out {out}: not empty and not a generate.py directory")
        return None
    try:
        with open(mpath) as f:
            m = json.load(f)
    except json.JSONDecodeError:
        raise UserError(f"{mpath}: corrupt; delete it or use another --out")
    if m.get("target") != target_name or m.get("tokenizer_hash") != tok_hash:
        raise UserError(f"--out {out}: holds data for target {m.get('target')!r} "
                        f"(tokenizer {str(m.get('tokenizer_hash'))[:12]}), not {target_name!r} "
                        f"(tokenizer {tok_hash[:12]}); use another --out")
    return m
