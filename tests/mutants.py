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
TREE = LK + "::test_tree_accepts_deep_paths_and_beats_the_chain"
CHAIN = LK + "::test_chain_accepts_exactly_what_the_draft_table_predicts"
POS = LK + "::test_draft_positions"
SP = "tests/test_speculate.py"
SAMPLING_FILE = "tests/test_sampling.py"
SAMPLING = SAMPLING_FILE + "::test_every_emitted_token_has_the_target_distribution"
TRAIN = "tests/test_train.py"
LEVERS = "tests/test_train_levers.py"
BAD = "tests/test_bad_inputs.py"
RESUME = "tests/test_bench.py::test_killed_run_resumes_where_it_stopped"
PAIRED = "tests/test_bench.py::test_paired_difference_prompt_by_prompt"
SLOTS = SP + "::test_tree_draft_attends_to_ancestors_or_sglang_slots"

# (name, file, old snippet, new snippet, tests to run). `old` must occur exactly once; old and
# new may also be tuples of snippets, applied in turn (a bug that spans several lines).
MUTANTS = [
    # ---- tree verification (the target side) ----
    ("verify-mask-root-parent-self", "speculate.py",
     "                anc[r] = anc[tree.parent[r]]\n",
     "                anc[r, 0] = anc[r, tree.parent[r]] = True\n", [TREE]),
    ("verify-mask-no-ancestors", "speculate.py",
     "                anc[r] = anc[tree.parent[r]]\n", "                pass\n", [TREE]),
    ("verify-positions-plus-one", "speculate.py",
     "        pos = (n + torch.tensor(tree.depth, device=self.device))[None]",
     "        pos = (n + 1 + torch.tensor(tree.depth, device=self.device))[None]", [TREE]),
    ("verify-positions-all-depth-1", "speculate.py",
     "        pos = (n + torch.tensor(tree.depth, device=self.device))[None]",
     "        pos = (n + torch.tensor([min(x, 1) for x in tree.depth], device=self.device))[None]",
     [TREE]),
    ("tree-kv-crop-not-gather", "speculate.py",
     "    contiguous = rows == list(range(k))", "    contiguous = True", [TREE]),
    ("accept-greedy-wrong-bonus", "speculate.py",
     "                return path, best[cur]", "                return path, best[path[0]]", [CHAIN]),
    # ---- tree drafting ----
    ("draft-tree-mask-ignores-ancestry", "speculate.py",
     "            mask = torch.cat([torch.ones(K, n, dtype=torch.bool, device=dev), anc], 1)[None, None]",
     "            mask = torch.cat([torch.ones(K, n, dtype=torch.bool, device=dev), "
     "torch.ones_like(anc)], 1)[None, None]", [TREE]),
    ("draft-tree-positions-plus-one", "speculate.py",
     "            pos = torch.full((1, K), n + depth - 2 + self.pos_shift, device=dev)",
     "            pos = torch.full((1, K), n + depth - 1 + self.pos_shift, device=dev)", [TREE]),
    ("draft-tree-positions-minus-one", "speculate.py",
     "            pos = torch.full((1, K), n + depth - 2 + self.pos_shift, device=dev)",
     "            pos = torch.full((1, K), n + depth - 3 + self.pos_shift, device=dev)", [TREE]),
    ("draft-tree-wrong-parent-state", "speculate.py",
     "            front_feat = h[0][best // K]",
     "            front_feat = h[0][best % K]", [TREE]),
    ("draft-tree-wrong-parent-ancestry", "speculate.py",
     "            anc = anc if self.sglang_slots else anc[best // K]",
     "            anc = anc if self.sglang_slots else anc[best % K]", [TREE, SLOTS]),
    ("draft-tree-sglang-slot-attention-always", "speculate.py",
     "            anc = anc if self.sglang_slots else anc[best // K]",
     "            anc = anc", [TREE, SLOTS]),
    ("draft-tree-sglang-slots-ignored", "speculate.py",
     "            anc = anc if self.sglang_slots else anc[best // K]",
     "            anc = anc[best // K]", [SLOTS]),
    ("draft-tree-ids-without-d2t", "speculate.py",
     "            lg, h = self.draft(self.draft_ids[front_tok][None], front_feat[None], pos,",
     "            lg, h = self.draft(front_tok[None], front_feat[None], pos,", [TREE]),
    ("draft-tree-root-feature-at-every-depth", "speculate.py",
     "            front_feat = h[0][best // K]",
     "            pass", [TREE]),
    ("draft-tree-drops-a-node", "speculate.py",
     "        order = torch.sort(score, descending=True, stable=True).indices[:self.num_draft_tokens - 1]",
     "        order = torch.sort(score, descending=True, stable=True).indices[:self.num_draft_tokens - 2]",
     [TREE]),
    ("draft-tree-parents-flattened-to-root", "speculate.py",
     "                    parent=[-1] + [row_of.get(parent[p], 0) for p in keep],",
     "                    parent=[-1] + [0 for p in keep],", [TREE]),
    # ---- chain drafting and the commit ----
    ("draft-chain-positions-plus-one", "speculate.py",
     "            pos = torch.tensor([[n + i + self.pos_shift]], device=self.device)",
     "            pos = torch.tensor([[n + i + 1 + self.pos_shift]], device=self.device)", [CHAIN]),
    ("draft-chain-positions-minus-one", "speculate.py",
     "            pos = torch.tensor([[n + i + self.pos_shift]], device=self.device)",
     "            pos = torch.tensor([[n + i - 1 + self.pos_shift]], device=self.device)", [CHAIN]),
    ("draft-chain-feeds-the-root", "speculate.py",
     "            lg, h = self.draft(torch.tensor([[toks[-1]]], device=self.device), f[None, None],",
     "            lg, h = self.draft(torch.tensor([[self.root]], device=self.device), f[None, None],",
     [CHAIN]),
    ("draft-chain-ids-without-d2t", "speculate.py",
     "            toks.append(int(self.draft_ids[d]))", "            toks.append(int(d))", [CHAIN]),
    ("draft-chain-stale-feature", "speculate.py",
     "            logits, f = lg[0, -1], h[0, -1]", "            logits = lg[0, -1]", [CHAIN]),
    ("commit-reextends-wrong-rows", "speculate.py",
     "                self.last = self.draft_extend(aux[path], new, n)",
     "                self.last = self.draft_extend(aux[:len(path)], new, n)", [TREE]),
    ("commit-reextends-at-wrong-position", "speculate.py",
     "                self.last = self.draft_extend(aux[path], new, n)",
     "                self.last = self.draft_extend(aux[path], new, n + 1)", [CHAIN]),
    ("draft-cache-not-cropped", "speculate.py",
     "            self.dcache.len = n                     # forget the draft's own speculative rows",
     "            pass", [CHAIN]),
    ("extend-positions-plus-one", "speculate.py",
     "        pos = torch.arange(n, n + T, device=self.device)[None]",
     "        pos = torch.arange(n + 1, n + T + 1, device=self.device)[None]", [CHAIN]),
    ("prefill-pairs-wrong-tokens", "speculate.py",
     "            self.last = self.draft_extend(aux, list(prompt_ids[1:]) + [self.root], 0)",
     "            self.last = self.draft_extend(aux, list(prompt_ids), 0)", [CHAIN]),
    ("sglang-positions-ignored", "speculate.py",
     "        self.pos_shift = 1 if sglang_positions else 0", "        self.pos_shift = 0", [POS]),
    ("sglang-positions-backwards", "speculate.py",
     "        self.pos_shift = 1 if sglang_positions else 0",
     "        self.pos_shift = -1 if sglang_positions else 0", [POS]),
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
    # ---- sampling ----
    ("sampling-ignores-temperature", "speculate.py",
     "    p = torch.softmax(logits.float() / temperature, dim=-1)",
     "    p = torch.softmax(logits.float(), dim=-1)", [SAMPLING]),
    ("sampling-ignores-top-p", "speculate.py",
     "    if top_p < 1.0:\n        sp, idx", "    if False:\n        sp, idx", [SAMPLING]),
    ("top-p-keeps-one-token-too-many", "speculate.py",
     "        drop = sp.cumsum(-1) - sp >= top_p", "        drop = sp.cumsum(-1) - 2 * sp >= top_p",
     [SAMPLING]),
    ("chain-depth-1-q-at-every-depth", "speculate.py",
     "                q[self.draft_ids] = tree.q[c - 1]", "                q[self.draft_ids] = tree.q[0]",
     [SAMPLING]),
    ("chain-residual-is-p", "speculate.py",
     "                resid = (p - q).clamp_min(0)", "                resid = p.clone()", [SAMPLING]),
    ("chain-accepts-with-p-over-q-squared", "speculate.py",
     "                if uniform(gen) * q[x] < p[x]:  # u < p/q without dividing",
     "                if uniform(gen) * q[x] * q[x] < p[x]:", [SAMPLING]),
    ("tree-rejected-sibling-keeps-its-mass", "speculate.py",
     "                p[x] = 0.0\n", "                p[x] = p[x] * 0.5\n", [SAMPLING]),
    ("tree-accepts-with-q-order-not-p", "speculate.py",
     "                if uniform(gen) < p[x]:",
     "                if uniform(gen) < p[x] ** 0.5:", [SAMPLING]),
    # ---- --check and bench must count mismatches ----
    ("check-mismatches-hard-wired-0", "speculate.py",
     "        mismatches = sum(not r[\"matches_target\"] for r in records)", "        mismatches = 0", [LK + "::test_check_counts_a_broken_verifier_and_exits_1"]),
    ("check-never-exits-1", "speculate.py",
     "    if args.check and summary[\"mismatches\"]:", "    if False:", [LK + "::test_check_counts_a_broken_verifier_and_exits_1"]),
    ("bench-mismatches-hard-wired-0", "bench.py",
     "                       else sum(not r[\"match\"] for r in records)),",
     "                       else 0),", [LK + "::test_bench_counts_mismatches"]),
    ("bench-compares-with-itself", "bench.py",
     "                        rec[\"match\"] = toks == base_toks if args.temperature == 0 else None",
     "                        rec[\"match\"] = toks == toks if args.temperature == 0 else None",
     [LK + "::test_bench_counts_mismatches"]),
    # ---- bench resumes a killed run ----
    ("bench-resume-reruns-everything", "bench.py",
     "                    if (label, qi, turn, rep) in done:", "                    if False:",
     [RESUME]),
    ("bench-resume-forgets-answers", "bench.py",
     "                            answers.append(line[\"answer\"])",
     "                            answers.append(\"\")", [RESUME]),
    ("bench-resume-drops-replayed-records", "bench.py",
     "                            recs[name].append(rec)\n                        if rep == 0:",
     "                            pass\n                        if rep == 0:", [RESUME]),
    ("bench-resume-ignores-settings", "bench.py",
     "                if old.get(key) != value:", "                if key == \"settings\" and False:",
     [RESUME]),
    ("bench-progress-kept-after-results", "bench.py",
     "        os.remove(progress_path(args.output))", "        pass", [RESUME]),
    ("bench-progress-saved-per-runner", "bench.py",
     ("                        got[r.name] = (toks, rec)\n",
      "                    progress.save((label, qi, turn, rep), {n: r for n, (_, r) in got.items()},\n                                  answer)\n"),
     ("                        got[r.name] = (toks, rec)\n                        progress.save((label, qi, turn, rep), {r.name: rec}, None)\n",
      "\n"),
     [RESUME]),
    ("bench-pairs-other-prompts", "bench_report.py",
     "    if not a or a.keys() != b.keys():", "    if not a:", [PAIRED]),
    ("bench-paired-interval-from-one-draw", "bench_report.py",
     "    boot = sorted(pooled([rows[rng.randrange(len(rows))] for _ in rows]) for _ in range(resamples))",
     "    boot = sorted(pooled(rows) for _ in range(resamples))", [PAIRED]),
    ("bench-paired-ties-as-ahead", "bench_report.py",
     "    return {\"ahead\": sum(d > 1e-12 for d in each)", "    return {\"ahead\": sum(d >= 0 for d in each)",
     [PAIRED]),
    # ---- bad input ----
    ("speculator-skips-sampling-checks", "speculate.py",
     "        check_sampling_args(temperature, top_p)\n        self.target", "        self.target",
     [BAD]),
    ("generate-skips-max-new-tokens-check", "speculate.py",
     "        if max_new_tokens < 1:\n", "        if max_new_tokens < 0:\n", [BAD]),
    ("generate-ignores-draft-positions", "speculate.py",
     "                           (\"draft\", self.draft.config.max_context())):",
     "                           (\"draft\", 10 ** 9)):", [BAD]),
    ("cli-top-p-allows-0", "speculate.py",
     "    if not 0 < args.top_p <= 1:", "    if not 0 <= args.top_p <= 1:", [BAD]),
    ("bench-top-p-allows-above-1", "bench.py",
     "    if not 0 < args.top_p <= 1:", "    if not 0 < args.top_p <= 2:", [BAD]),
    ("train-lr-0-allowed", "train.py", "    if not a.lr > 0 or", "    if not a.lr >= 0 or", [BAD]),
    ("train-ttt-length-0-allowed", "train.py",
     "    for name in (\"ttt_length\", \"batch_size\",", "    for name in (\"batch_size\",", [BAD]),
    ("train-resume-with-init-allowed", "train.py",
     "    if a.resume and a.init:", "    if False:", [BAD]),
    ("load-skips-d2t-check", "model.py",
     "        check_draft_ids(ids, cfg.draft_vocab_size, cfg.vocab_size, f\"{wpath}: d2t\")\n", "", [BAD]),
    ("load-skips-t2d-check", "model.py",
     "        if not torch.equal(sd[\"t2d\"].bool(), t2d):", "        if False:", [BAD]),
    # ---- RoPE scaling ----
    ("draft-rope-ignores-scaling", "model.py",
     "        if cfg.rope_scaling:\n            params.update", "        if False:\n            params.update",
     [BAD]),
    ("config-drops-rope-scaling", "draft_config.py",
     "    rope_scaling = None if rope_type == \"default\" else {k: v for k, v in rope.items()",
     "    rope_scaling = None if True else {k: v for k, v in rope.items()", [BAD]),
    ("draft-rope-scale-dropped", "model.py",
     "        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)",
     "        return emb.cos().to(dtype), emb.sin().to(dtype)", [BAD]),
    # ---- resume ----
    ("resume-restores-nothing-and-says-so-quietly", "train.py",
     ("        st = load_checkpoint(ck[-1], r.module, r.opts, r.scheds, rank, r.world, r.vocab[\"draft_ids\"],\n"
      "                             same_run)",
      "        start, tokens_seen = st[\"step\"], st[\"data\"].get(\"tokens\", 0)",
      "            print(f\"resumed from {ck[-1]} at step {start}\", file=sys.stderr)"),
     ("        st = {\"args\": vars(args), \"step\": int(os.path.basename(ck[-1])[5:]), \"data\": {}}",
      "        start, tokens_seen = 0, 0",
      "            print(f\"resumed from {ck[-1]} at step {st['step']}\", file=sys.stderr)"),
     [TRAIN + "::test_kill_and_resume_gives_identical_weights"]),
    ("resume-starts-at-step-0", "train.py",
     "        start, tokens_seen = st[\"step\"], st[\"data\"].get(\"tokens\", 0)",
     "        start, tokens_seen = 0, 0", [TRAIN + "::test_kill_and_resume_gives_identical_weights"]),
    ("online-resume-producer-from-step-0", "train.py",
     "                 for s in range(r.start, r.stop_at)]", "                 for s in range(0, r.stop_at)]",
     [TRAIN + "::test_online_kill_and_resume"]),
    # ---- training levers (issue 23) ----
    ("feature-noise-also-in-the-eval", "train.py",
     "    if key[0] == \"train\" and r.args.feature_noise:", "    if r.args.feature_noise:",
     [LEVERS + "::test_noise_and_cut_labels_reach_training_not_the_eval"]),
    ("distill-topk-ignored", "train.py",
     "        targ_p = top_k_labels(targ_p, r.args.distill_topk)", "        targ_p = targ_p",
     [LEVERS + "::test_noise_and_cut_labels_reach_training_not_the_eval"]),
    ("layer-init-token-half", "draft_init.py",
     "    pairs += [(getattr(dst.self_attn, n).weight[:, H:], getattr(src.self_attn, n).weight, 1.0)",
     "    pairs += [(getattr(dst.self_attn, n).weight[:, :H], getattr(src.self_attn, n).weight, 1.0)",
     ["tests/test_levers.py::test_layer_init_from_target"]),
    ("layer-init-unscaled", "draft_init.py",
     "             (dst.mlp.down_proj.weight, src.mlp.down_proj.weight, 1 / r)]",
     "             (dst.mlp.down_proj.weight, src.mlp.down_proj.weight, 1.0)]",
     ["tests/test_levers.py::test_layer_init_from_target"]),
    ("layer-init-row-0-in-the-scale", "draft_init.py",
     "            x = model(ids, output_hidden_states=True).hidden_states[L][0, 1:]   # input of layer L",
     "            x = model(ids, output_hidden_states=True).hidden_states[L][0]",
     ["tests/test_levers.py::test_layer_init_from_target"]),
    ("muon-takes-lm-head", "optim.py",
     "    muon = [p for n, p in named if p.ndim == 2 and min(p.shape) > 1 and \"lm_head\" not in n]",
     "    muon = [p for n, p in named if p.ndim == 2 and min(p.shape) > 1]",
     [LEVERS + "::test_muon_orthogonalises_matrices_and_leaves_lm_head_to_adamw"]),
    ("muon-state-not-restored", "rundir.py",
     "    set_optimizer_state_dict(module, opts, st[\"optim\"], options=state_options())",
     "    set_optimizer_state_dict(module, opts, st[\"optim\"], options=state_options())\n"
     "    [o.state.clear() for o in opts[1:]]     # Muon's momentum lost on resume",
     [TRAIN + "::test_ctrl_c_saves_and_resume_gives_identical_weights"]),
    # ---- training metrics and export ----
    ("export-perturbs-non-lm-head", "model.py",
     "        sd = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()",
     "        sd = {k: ((v * (1 if \"lm_head\" in k else 1.001)).to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()",
     [TRAIN + "::test_offline_run_exports_loadable_draft_and_learns"]),
    ("replay-skips-the-bonus-token", "ttt.py",
     "                t += a + 1\n", "                t += a + 2\n", [LK + "::test_training_replay_equals_speculate"]),
    # ---- more of the same kinds (session 9): tree verify/draft, chain, commit, sampling, resume,
    # TTT masks, layouts ----
    ("verify-tree-as-causal-chain", "speculate.py",
     "        if self.topk == 1:   # a chain: ordinary causal attention",
     "        if True:   # a chain: ordinary causal attention", [TREE]),
    ("verify-tree-node-blind-to-itself", "speculate.py",
     "            anc[r, r] = True\n", "            anc[r, r] = r == 0\n", [TREE]),
    ("draft-tree-scores-not-cumulative", "speculate.py",
     "            cand_score = (front_score[:, None] + child.values).flatten()",
     "            cand_score = child.values.flatten()", [TREE]),
    ("draft-tree-frontier-token-of-first-child", "speculate.py",
     "            front_score, front_tok = cand_score[best], child.indices.flatten()[best]",
     "            front_score, front_tok = cand_score[best], child.indices[:, 0][best // K]", [TREE]),
    ("draft-tree-keeps-worst-nodes", "speculate.py",
     "        order = torch.sort(score, descending=True, stable=True)",
     "        order = torch.sort(score, descending=False, stable=True)", [TREE]),
    ("draft-chain-one-token-short", "speculate.py",
     "        for i in range(self.num_draft_tokens - 1):", "        for i in range(self.num_draft_tokens - 2):",
     [CHAIN]),
    ("commit-counts-one-row-less", "speculate.py",
     "            n += len(path)\n", "            n += len(path) - 1\n", [CHAIN]),
    ("tree-kv-gather-off-by-one", "speculate.py",
     "    idx = None if contiguous else torch.tensor(rows, device=cache.layers[0].keys.device) + n",
     "    idx = None if contiguous else torch.tensor(rows, device=cache.layers[0].keys.device) + n - 1",
     [TREE]),
    ("chain-residual-not-clamped", "speculate.py",
     "                resid = (p - q).clamp_min(0)", "                resid = (p - q).abs()", [SAMPLING]),
    ("tree-no-renormalise-after-rejection", "speculate.py",
     "                p = p / p.sum()\n", "", [SAMPLING, SAMPLING_FILE + "::test_tree_siblings_rule_on_one_node"]),
    ("bonus-after-full-accept-is-argmax", "speculate.py",
     "                return path, sample(p, gen)\n            if tree.q",
     "                return path, int(p.argmax())\n            if tree.q", [SAMPLING]),
    ("first-token-greedy-when-sampling", "speculate.py",
     "        self.root = int(logits[-1].argmax()) if self.greedy else sample(",
     "        self.root = int(logits[-1].argmax()) if True else sample(",
     [SAMPLING, SAMPLING_FILE + "::test_first_token_is_sampled"]),
    ("resume-model-not-restored", "rundir.py",
     "    set_model_state_dict(module, sd, options=state_options(strict=False))\n", "",
     [TRAIN + "::test_kill_and_resume_gives_identical_weights"]),
    ("resume-optimizer-not-restored", "rundir.py",
     "    set_optimizer_state_dict(module, opts, st[\"optim\"], options=state_options())\n", "",
     [TRAIN + "::test_kill_and_resume_gives_identical_weights"]),
    ("resume-schedule-not-restored", "rundir.py",
     "        s.load_state_dict(sd)\n", "        pass\n",
     [TRAIN + "::test_kill_and_resume_gives_identical_weights"]),
    ("ttt-loss-mask-one-step-early", "ttt.py",
     "    return torch.stack([shift_left(mask, j + 2, False) & shift_left(in_vocab, j + 1, False)",
     "    return torch.stack([shift_left(mask, j + 1, False) & shift_left(in_vocab, j + 1, False)",
     [TRAIN + "::test_target_side_and_masks", TRAIN + "::test_ttt_matches_step_by_step_decoding"]),
    ("norm-before-residual-ignored", "model.py",
     "        h1 = (self.hidden_norm(g) if self.norm_residual else g) + attn_out",
     "        h1 = g + attn_out", ["tests/test_speculators_layout.py"]),
    ("norm-output-ignored", "model.py",
     "        if not self.config.norm_output:\n            return h2",
     "        if True:\n            return h2", ["tests/test_layouts.py"]),
    ("fc-norm-skipped", "model.py",
     "        if self.fc_norm is not None:\n            parts", "        if False:\n            parts",
     ["tests/test_layouts.py"]),
    # ---- the training loop's steps (session 29's split of train_loop) ----
    ("ctrl-c-flag-not-shared", "train.py",
     "             1.0 if stop_here else 0.0]", "             0.0]",
     [TRAIN + "::test_ctrl_c_saves_and_resume_gives_identical_weights"]),
    ("nan-step-applied", "train.py",
     "    if bad:\n        raise UserError(f\"step {step}: loss",
     "    if False:\n        raise UserError(f\"step {step}: loss",
     [TRAIN + "::test_nan_loss_stops_and_keeps_last_good_checkpoint"]),
    ("log-window-never-resets", "train.py",
     "                              al3=f\"{m['accept_len_3']:.2f}\", wait=f\"{rec['data_wait']:.0%}\")\n        self.reset()",
     "                              al3=f\"{m['accept_len_3']:.2f}\", wait=f\"{rec['data_wait']:.0%}\")\n        self.t0 = time.perf_counter()",
     [TRAIN + "::test_log_window_sums_only_its_own_steps"]),
    ("init-run-skips-step-0-eval", "train.py",
     "    if r.eval_batches and r.start == 0 and args.init:",
     "    if False:", ["tests/test_levers.py::test_continued_run_evaluates_its_start"]),
    # ---- model.py --average (session 32) ----
    ("average-keeps-the-last", "model.py",
     "        total = sd if total is None else {k: total[k] + v for k, v in sd.items()}",
     "        total = {k: v * len(args.average) for k, v in sd.items()}",
     ["tests/test_cli.py::test_model_cli_averages_checkpoints"]),
    ("average-ignores-vocab-map", "model.py",
     "        if d2t is not None and not torch.equal(sd[\"d2t\"], d2t):",
     "        if False:", ["tests/test_cli.py::test_model_cli_averages_checkpoints"]),
]


def edits(old, new):
    return list(zip(old, new)) if isinstance(old, tuple) else [(old, new)]


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
    ap.add_argument("--from", dest="start", default=None, help="start at this mutant (resume a run)")
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    todo = [m for m in MUTANTS if args.k in m[0]]
    if args.start:
        todo = todo[[m[0] for m in todo].index(args.start):]
    if args.list:
        for name, f, *_ , tests in todo:
            print(f"{name:45s} {f:14s} {' '.join(tests)}")
        return
    for name, f, old, new, _ in todo:    # every snippet must still be in the code, once
        src = open(os.path.join(ROOT, f)).read()
        for o in edits(old, new):
            if src.count(o[0]) != 1:
                sys.exit(f"mutant {name}: its snippet occurs {src.count(o[0])} times in {f}; "
                         f"update tests/mutants.py")
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
        for o, n in edits(old, new):
            src = src.replace(o, n)
        with open(path, "w") as fh:
            fh.write(src)
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
