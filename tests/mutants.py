"""Deliberate bugs, and whether the tests that claim to cover each place catch it.

Not part of the default suite (pytest collects only test_*.py). Each mutant is one textual
change in one file; the runner copies the repository to a scratch folder, applies the change
there (never in this checkout), runs the covering tests and reports KILLED (a test failed) or
SURVIVED (every covering test passed: the suite has a hole). Before the mutants it runs every
covering test on an unmodified copy, which must pass.

    python tests/mutants.py                 # all mutants
    python tests/mutants.py -k tree         # those whose name contains 'tree'
    python tests/mutants.py --list
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRATCH = os.environ.get("MUTANTS_DIR", "/root/scratch/mutants")

LK = "tests/test_lookup.py"
SP = "tests/test_speculate.py"
SAMPLING = "tests/test_sampling.py"
STRICT = "tests/test_strict.py"
TRAIN = "tests/test_train.py"

# (name, file, old snippet, new snippet, tests to run). `old` must occur exactly once.
MUTANTS = [
    # ---- tree verification (the target side) ----
    ("verify-mask-root-parent-self", "speculate.py",
     "                anc[r] = anc[tree.parent[r]]\n",
     "                anc[r, 0] = anc[r, tree.parent[r]] = True\n", [LK]),
    ("verify-mask-no-ancestors", "speculate.py",
     "                anc[r] = anc[tree.parent[r]]\n", "                pass\n", [LK]),
    ("verify-positions-plus-one", "speculate.py",
     "        pos = (n + torch.tensor(tree.depth, device=self.device))[None]",
     "        pos = (n + 1 + torch.tensor(tree.depth, device=self.device))[None]", [LK]),
    ("verify-positions-all-depth-1", "speculate.py",
     "        pos = (n + torch.tensor(tree.depth, device=self.device))[None]",
     "        pos = (n + torch.tensor([min(x, 1) for x in tree.depth], device=self.device))[None]",
     [LK]),
    ("tree-kv-crop-not-gather", "speculate.py",
     "    contiguous = rows == list(range(k))", "    contiguous = True", [LK]),
    ("accept-greedy-wrong-bonus", "speculate.py",
     "                return path, best[cur]", "                return path, best[path[0]]", [LK]),
    # ---- tree drafting ----
    ("draft-tree-mask-ignores-ancestry", "speculate.py",
     "            mask = torch.cat([torch.ones(K, n, dtype=torch.bool, device=dev), anc], 1)[None, None]",
     "            mask = torch.cat([torch.ones(K, n, dtype=torch.bool, device=dev), "
     "torch.ones_like(anc)], 1)[None, None]", [LK]),
    ("draft-tree-positions-plus-one", "speculate.py",
     "            pos = torch.full((1, K), n + depth - 2 + self.pos_shift, device=dev)",
     "            pos = torch.full((1, K), n + depth - 1 + self.pos_shift, device=dev)", [LK]),
    ("draft-tree-positions-minus-one", "speculate.py",
     "            pos = torch.full((1, K), n + depth - 2 + self.pos_shift, device=dev)",
     "            pos = torch.full((1, K), n + depth - 3 + self.pos_shift, device=dev)", [LK]),
    ("draft-tree-wrong-parent-state", "speculate.py",
     "            front_feat, anc = h[0][best // K], anc[best // K]",
     "            front_feat, anc = h[0][best % K], anc[best // K]", [LK]),
    ("draft-tree-wrong-parent-ancestry", "speculate.py",
     "            front_feat, anc = h[0][best // K], anc[best // K]",
     "            front_feat, anc = h[0][best // K], anc[best % K]", [LK]),
    ("draft-tree-ids-without-d2t", "speculate.py",
     "            lg, h = self.draft(self.draft_ids[front_tok][None], front_feat[None], pos,",
     "            lg, h = self.draft(front_tok[None], front_feat[None], pos,", [LK]),
    ("draft-tree-root-feature-at-every-depth", "speculate.py",
     "            front_feat, anc = h[0][best // K], anc[best // K]",
     "            anc = anc[best // K]", [LK]),
    ("draft-tree-drops-a-node", "speculate.py",
     "        order = torch.sort(score, descending=True, stable=True).indices[:self.num_draft_tokens - 1]",
     "        order = torch.sort(score, descending=True, stable=True).indices[:self.num_draft_tokens - 2]",
     [LK]),
    ("draft-tree-parents-flattened-to-root", "speculate.py",
     "                    parent=[-1] + [row_of.get(parent[p], 0) for p in keep],",
     "                    parent=[-1] + [0 for p in keep],", [LK]),
    # ---- chain drafting and the commit ----
    ("draft-chain-positions-plus-one", "speculate.py",
     "            pos = torch.tensor([[n + i + self.pos_shift]], device=self.device)",
     "            pos = torch.tensor([[n + i + 1 + self.pos_shift]], device=self.device)", [LK]),
    ("draft-chain-positions-minus-one", "speculate.py",
     "            pos = torch.tensor([[n + i + self.pos_shift]], device=self.device)",
     "            pos = torch.tensor([[n + i - 1 + self.pos_shift]], device=self.device)", [LK]),
    ("draft-chain-feeds-the-root", "speculate.py",
     "            lg, h = self.draft(torch.tensor([[toks[-1]]], device=self.device), f[None, None],",
     "            lg, h = self.draft(torch.tensor([[self.root]], device=self.device), f[None, None],",
     [LK]),
    ("draft-chain-ids-without-d2t", "speculate.py",
     "            toks.append(int(self.draft_ids[d]))", "            toks.append(int(d))", [LK]),
    ("draft-chain-stale-feature", "speculate.py",
     "            logits, f = lg[0, -1], h[0, -1]", "            logits = lg[0, -1]", [LK]),
    ("commit-reextends-wrong-rows", "speculate.py",
     "                self.last = self.draft_extend(aux[path], new, n)",
     "                self.last = self.draft_extend(aux[:len(path)], new, n)", [LK]),
    ("commit-reextends-at-wrong-position", "speculate.py",
     "                self.last = self.draft_extend(aux[path], new, n)",
     "                self.last = self.draft_extend(aux[path], new, n + 1)", [LK]),
    ("draft-cache-not-cropped", "speculate.py",
     "            self.dcache.len = n                     # forget the draft's own speculative rows",
     "            pass", [LK]),
    ("extend-positions-plus-one", "speculate.py",
     "        pos = torch.arange(n, n + T, device=self.device)[None]",
     "        pos = torch.arange(n + 1, n + T + 1, device=self.device)[None]", [LK]),
    ("prefill-pairs-wrong-tokens", "speculate.py",
     "            self.last = self.draft_extend(aux, list(prompt_ids[1:]) + [self.root], 0)",
     "            self.last = self.draft_extend(aux, list(prompt_ids), 0)", [LK]),
    ("sglang-positions-ignored", "speculate.py",
     "        self.pos_shift = 1 if sglang_positions else 0", "        self.pos_shift = 0", [LK]),
    ("sglang-positions-backwards", "speculate.py",
     "        self.pos_shift = 1 if sglang_positions else 0",
     "        self.pos_shift = -1 if sglang_positions else 0", [LK]),
    # ---- training-time test: the same row/position convention as decoding ----
    ("ttt-positions-plus-one", "ttt.py",
     "        cos, sin = draft.rotary(pos + j, g.dtype)",
     "        cos, sin = draft.rotary(pos + j + (j > 0), g.dtype)", [LK + "::test_training_replay_equals_speculate"]),
    ("ttt-positions-minus-one", "ttt.py",
     "        cos, sin = draft.rotary(pos + j, g.dtype)",
     "        cos, sin = draft.rotary(pos + j - (j > 0), g.dtype)", [LK + "::test_training_replay_equals_speculate"]),
    ("ttt-wrong-token-at-draft-steps", "ttt.py",
     "        e = draft.embed_tokens(shift_left(ids, j + 1)).to(g.dtype)",
     "        e = draft.embed_tokens(shift_left(ids, 1)).to(g.dtype)", [LK + "::test_training_replay_equals_speculate"]),
]


def covering_tests():
    return sorted({t for m in MUTANTS for t in m[4]})


def copy_tree(dst):
    """The working tree without .git and the big result folders (drafts/ is linked: the tests
    only read it)."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    skip = {".git", "drafts", "results", "__pycache__", ".pytest_cache"}
    shutil.copytree(ROOT, dst, ignore=lambda d, names: [n for n in names if n in skip])
    os.symlink(os.path.join(ROOT, "drafts"), os.path.join(dst, "drafts"))


def run_tests(tree, tests, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "timeout", time.time() - t0
    tail = [l for l in p.stdout.strip().splitlines() if l.strip()]
    return p.returncode, tail[-1] if tail else p.stderr[-300:], time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only mutants whose name contains this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmodified run")
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    todo = [m for m in MUTANTS if args.k in m[0]]
    if args.list:
        for name, f, *_ , tests in todo:
            print(f"{name:45s} {f:14s} {' '.join(tests)}")
        return
    for name, f, old, new, _ in todo:    # every snippet must still be in the code, once
        n = open(os.path.join(ROOT, f)).read().count(old)
        if n != 1:
            sys.exit(f"mutant {name}: its snippet occurs {n} times in {f}; update tests/mutants.py")
    base = os.path.join(SCRATCH, "baseline")
    if not args.no_baseline:
        copy_tree(base)
        tests = sorted({t for m in todo for t in m[4]})
        rc, tail, dt = run_tests(base, tests, args.timeout * 2)
        print(f"baseline ({' '.join(tests)}): {tail} [{dt:.0f}s]", flush=True)
        if rc != 0:
            sys.exit("the covering tests fail without any mutant: fix that first")
    killed, survived = [], []
    for name, f, old, new, tests in todo:
        tree = os.path.join(SCRATCH, name)
        copy_tree(tree)
        path = os.path.join(tree, f)
        src = open(path).read()
        with open(path, "w") as fh:
            fh.write(src.replace(old, new))
        try:
            compile(open(path).read(), path, "exec")
        except SyntaxError as e:
            sys.exit(f"mutant {name} is not valid Python ({e}); fix its snippet")
        rc, tail, dt = run_tests(tree, tests, args.timeout)
        ok = rc != 0
        (killed if ok else survived).append(name)
        print(f"{'KILLED  ' if ok else 'SURVIVED'} {name:45s} {tail} [{dt:.0f}s]", flush=True)
        shutil.rmtree(tree)
    print(f"\n{len(killed)} of {len(todo)} mutants killed"
          + (f"; survived: {', '.join(survived)}" if survived else ""))
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
