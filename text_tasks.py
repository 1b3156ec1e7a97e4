"""
Prompts that hand the target a text to work on: summarise it, extract from it, rewrite it, fix it,
explain or comment code. Feed them to generate.py --prompts like any other prompt file.

Why. A draft learns to copy spans of its context only from answers that copy. Magpie prompts
from a small target are short questions with nothing in them to copy, while users (and MT-Bench's
extraction and writing questions) paste a text and ask for it back, changed a little. There prompt
lookup, which only copies, beats a draft trained on self-written questions by 2x (bench.py's
MT-Bench table by category). The texts here are the target's own earlier answers (a
conversations.jsonl written by generate.py), so no outside data is involved; the instructions are
generic templates, and half the conversations get a generic follow-up turn about the answer
("make it shorter"), which the target also answers by reworking text already in its context.

    python text_tasks.py --source data/run/conversations.jsonl --n 1000 --out tasks.jsonl
    python generate.py --prompts tasks.jsonl --out data/tasks --temperature 0 ...
"""
import argparse
import json
import random
import re

from common import UserError, atomic_write_text, read_conversations, run_main

TEXT_TASKS = [
    "Summarize the following text in two sentences.",
    "Summarize the following text in one paragraph.",
    "Extract the main points of the following text as a bulleted list.",
    "List every concrete example mentioned in the following text.",
    "Extract all names, places, numbers and dates that appear in the following text.",
    "Rewrite the following text in a more formal tone.",
    "Rewrite the following text so that a ten-year-old can understand it.",
    "Rewrite the following text in a friendly, casual tone.",
    "Paraphrase the following text.",
    "Correct any grammar or spelling mistakes in the following text and return the corrected text.",
    "Turn the following text into a numbered list of steps or points.",
    "Give the following text a title and a one-sentence summary.",
    "What is the main claim of the following text? Quote the sentence that states it.",
    "Find the sentence in the following text that gives the most useful advice, and quote it.",
    "Return a JSON object with the keys \"topic\", \"key_points\" and \"tone\" for the following text.",
    "Continue the following text with one more paragraph in the same style.",
    "Shorten the following text to about half its length, keeping the key information.",
    "Make a table with two columns, \"point\" and \"explanation\", from the following text.",
    "Write three questions that the following text answers, each with its answer.",
    "Proofread the following text and list any changes you would make.",
]
CODE_TASKS = [
    "Add comments to the following code explaining what each part does.",
    "Explain what the following code does, line by line.",
    "Rewrite the following code with clearer variable names.",
    "Find any bugs in the following code and return a corrected version.",
    "Add type hints and a docstring to the following code.",
    "Write a unit test for the following code.",
]
FOLLOWUPS = [
    "Make your answer shorter.",
    "Rewrite your answer as a bulleted list.",
    "Now rewrite your answer in a more formal tone.",
    "Can you add one more example to your answer?",
    "Explain your answer in simpler words.",
    "Put your answer in a table.",
    "Summarize your answer in one sentence.",
    "Which part of the text is the most important? Quote it.",
]
# Where the text goes. When it comes first, "the following text" becomes "the text above".
FRAMES = [
    "{task}\n\n{text}",
    "{task}\n\nText:\n{text}",
    "{task}\n\n\"\"\"\n{text}\n\"\"\"",
    "{text}\n\n{task}",
    "Here is a text:\n\n{text}\n\n{task}",
]


def passage(answer, rng, lo=40, hi=160):
    """Whole sentences of an answer, lo..hi words, or None. An answer cut at --max-new-tokens
    ("truncated") loses its unfinished last sentence; a long one gives a run of paragraphs from a
    random paragraph on."""
    text = answer["content"].strip()
    if answer.get("truncated"):
        cut = max(text.rfind(". "), text.rfind(".\n"), text.rfind("!"), text.rfind("?"))
        text = text[:cut + 1] if cut > 0 else ""
    if len(text.split()) < lo:
        return None
    if len(text.split()) > hi:
        paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
        kept = []
        for p in paras[rng.randrange(len(paras)):]:
            if len(" ".join(kept + [p]).split()) > hi:
                break
            kept.append(p)
        text = "\n\n".join(kept)
        if len(text.split()) < lo:
            return None
    return text


def code_block(answer):
    """The first fenced code block of an answer with at least 4 lines, fences included."""
    m = re.search(r"```(\w*)\n(.*?)```", answer["content"], re.S)
    if not m or len(m.group(2).split("\n")) < 4:
        return None
    return f"```{m.group(1)}\n{m.group(2)}```"


def make_tasks(convs, n, seed):
    """Up to n conversations [user task (+ empty answer + follow-up)], one per distinct text."""
    rng = random.Random(seed)
    answers = [m for c in convs for m in c if m["role"] == "assistant" and m["content"].strip()]
    rng.shuffle(answers)
    rows, seen = [], set()
    for a in answers:
        if len(rows) >= n:
            break
        code, text = code_block(a), passage(a, rng)
        if code is not None and (text is None or rng.random() < 0.7):  # most code: a code task
            task, text = rng.choice(CODE_TASKS), code
        elif text is not None:
            task = rng.choice(TEXT_TASKS)
        if text is None or text in seen:
            continue
        seen.add(text)
        frame = rng.choice(FRAMES)
        if not frame.startswith("{task}"):
            task = (task.replace("the following", "the above")
                    .replace("the above text", "the text above"))
        msgs = [{"role": "user", "content": frame.format(task=task, text=text)}]
        if rng.random() < 0.5:  # the answer is a hole generate.py fills; then the follow-up
            msgs += [{"role": "assistant", "content": ""},
                     {"role": "user", "content": rng.choice(FOLLOWUPS)}]
        rows.append({"messages": msgs})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--source", required=True,
                    help="conversations JSONL whose assistant answers give the texts "
                         "(e.g. a generate.py output's conversations.jsonl)")
    ap.add_argument("--n", type=int, required=True, help="how many prompts to write")
    ap.add_argument("--out", required=True, help="JSONL to write ({\"messages\": [...]} lines)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-bad", action="store_true", help="skip malformed --source lines")
    args = ap.parse_args(argv)
    if args.n < 1:
        raise UserError(f"--n {args.n}: expected >= 1")
    convs, _ = read_conversations(args.source, args.skip_bad, flag="--source")
    rows = make_tasks(convs, args.n, args.seed)
    if not rows:
        raise UserError(f"--source {args.source}: no assistant answer has 40+ words or a code "
                        f"block to work on")
    atomic_write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} prompts ({sum(len(r['messages']) > 1 for r in rows)} with a follow-up) "
          f"from {args.source} -> {args.out}")


if __name__ == "__main__":
    run_main(main)
