"""
Conversations -> training samples: render with the target's chat template, then mark which tokens
are in the loss (the assistant's own tokens, end-of-turn included, header excluded).

Two things make this less simple than it looks, and both are handled here for any template and
any tokenizer (fast Rust ones, and slow Python ones such as Kimi's tiktoken tokenizer, which have
no character offsets):

1. Where does an assistant turn start and end? Found in TEXT without knowing the template's header
   strings: for assistant turn i, rendering turns [:i] with the generation prompt ends exactly where
   the answer starts, and rendering [:i+1] ends after its end-of-turn marker (plus whitespace such as
   ChatML's trailing newline, which the model never generates and is left out; a turn marked
   "truncated" loses its end-of-turn marker too, since the target never produced it).

2. Which TOKENS lie in a character span? A token is in the loss if its first character is. With
   ids = tokenize(text), the number of tokens starting before character b is found by tokenizing the
   prefix text[:b]: if that gives a prefix of ids, the boundary is exact. If not (a token of ids
   straddles b, or the prefix alone merges tokens that the whole text keeps apart), the tokens
   after the common prefix are walked with decode() until one starts at or after b. No offsets
   needed; on a fast tokenizer this gives exactly the masks the offset mapping gives
   (tests/test_generate.py checks this).

Training shape. Most templates render incrementally: the rendering of a conversation up to any
assistant turn is a prefix of the whole rendering. Then a conversation is ONE sample, every
assistant turn in its loss. Thinking templates (Qwen3, Kimi-K2.5 style) drop the reasoning of
earlier turns once a later user turn exists, so the whole rendering shows earlier answers in a form
the model never produced. Then a conversation becomes ONE SAMPLE PER ASSISTANT TURN: sample k is
turns [:k+1] rendered exactly as the model sees them when it writes turn k (earlier reasoning
already dropped, turn k's own reasoning kept), with only turn k in the loss. Every assistant token
is trained on once, always in the context the target produced it in; the price is that turn k's
context is recomputed in every later sample (quadratic in the number of turns).
"""
import json

from common import UserError


def render(tok, messages, add_generation_prompt=False):
    from jinja2.exceptions import TemplateError
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        return tok.apply_chat_template(msgs, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    except TemplateError as e:  # e.g. "roles must alternate user/assistant"
        raise UserError(f"the chat template refuses a conversation ({e}): "
                        f"{json.dumps(msgs, ensure_ascii=False)[:200]}")


def turn_span(tok, messages, i):
    """(upto, (start, end)): the rendering of turns [:i+1] and the characters of assistant turn
    i's loss part in it."""
    before = render(tok, messages[:i], add_generation_prompt=True)
    upto = render(tok, messages[:i + 1])
    if not upto.startswith(before):
        raise UserError("the chat template does not render conversations incrementally even up "
                        "to the turn being answered (adding an assistant turn changes the text "
                        "before it), so the assistant spans cannot be located")
    end = len(upto.rstrip())
    if messages[i].get("truncated"):
        # cut at --max-new-tokens: the end-of-turn marker after it is the template's, not
        # the target's, so it stays out of the loss (the answer text itself stays in)
        text = messages[i]["content"].strip()
        j = upto.find(text, len(before)) if text else -1
        end = j + len(text) if j >= 0 else len(before)
    return upto, (len(before), end)


def encode(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def tokens_before(tok, text, ids, b):
    """How many tokens of ids = tokenize(text) start before character b (see the docstring)."""
    if b <= 0:
        return 0
    if b >= len(text):
        return len(ids)
    pre = encode(tok, text[:b])
    n = 0
    while n < len(pre) and n < len(ids) and pre[n] == ids[n]:
        n += 1
    if n == len(pre):
        return n          # text[:b] tokenizes to a prefix of ids: b is a token boundary
    # Token n of ids starts where the prefix's token n does, before b. Either it straddles b, or
    # the prefix merged tokens that ids keeps apart (pre-splitting depends on what follows: "\n\n"
    # before a word is two tokens, at the end of a text one). Walk on: token m starts at
    # len(decode(ids[:m])) while that decodes to a prefix of the text.
    m = n + 1
    while m < len(ids):
        d = tok.decode(ids[:m], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not text.startswith(d) or len(d) >= b:
            break
        m += 1
    return m


def mask_spans(tok, text, spans):
    """(input_ids, loss_mask) of text with the tokens starting inside any (start, end) span masked."""
    ids = encode(tok, text)
    mask = [0] * len(ids)
    for a, b in spans:
        for t in range(tokens_before(tok, text, ids, a), tokens_before(tok, text, ids, b)):
            mask[t] = 1
    return ids, mask


def encode_samples(tok, messages, max_length=None):
    """Training samples [(input_ids, loss_mask, turn)] of one conversation: one sample (turn None)
    when the template renders incrementally, else one per assistant turn (turn = message index).
    Each is truncated to max_length tokens."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    parts = [turn_span(tok, messages, i) for i in turns]
    full = render(tok, messages)
    if all(full.startswith(upto) for upto, _ in parts):
        ids, mask = mask_spans(tok, full, [span for _, span in parts])
        samples = [(ids, mask, None)]
    else:
        samples = [mask_spans(tok, upto, [span]) + (i,) for i, (upto, span) in zip(turns, parts)]
    if max_length is not None:
        samples = [(ids[:max_length], mask[:max_length], t) for ids, mask, t in samples]
    return samples


def encode_conversation(tok, messages, max_length=None):
    """(input_ids, loss_mask) of a conversation as ONE sample; an error for templates that do not
    render incrementally (use encode_samples, which splits those per turn)."""
    samples = encode_samples(tok, messages, max_length)
    if len(samples) != 1 or samples[0][2] is not None:
        raise UserError("the chat template does not render conversations incrementally (an "
                        "earlier turn changes when later turns are added): encode it per turn")
    return samples[0][:2]
