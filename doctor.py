"""
The draft doctor: finds the ways an EAGLE-3 draft is served differently from how it was trained,
before it is served. `python model.py DRAFT --doctor [--target T]` prints one line per check,

    PASS  field: what was found
    FAIL  field: what was found; expected ...
    INFO  field: a measurement or a fact with nothing to compare it against
    SKIP  field: why the check could not run (never counted as passing)

and exits 1 if any line is FAIL. Each root cause of "training looks good, accept length ~1 when
served" seen in public threads has a check:

- the aux-layer convention (SGLang's eagle_config ids i = the OUTPUT of layer i; vLLM's and
  speculators' top-level ids k = the INPUT of layer k = i + 1; vLLM reads eagle_config's ids AS
  k when the top-level key is absent, one layer early: SGLang PR 25454, an off-by-one in exports);
- a norm flag an engine does not read, or reads from another key (norm_before_fc dropped: SGLang
  PR 32334; vLLM's speculators loader defaults norm_before_residual to TRUE; SGLang never reads it;
  vLLM reads fc_norm but not its legacy name use_aux_norm);
- d2t missing (both engines then map draft id i to target id i), or holding absolute ids although
  it is an offset table (NeMo-Automodel PR 2447, verl-SpeCo PR 67);
- RoPE: partial_rotary_factor read by both engines but not by the trainer (speculators issue 613),
  theta / scaling / max positions other than the target's;
- an EAGLE(-1/2) class or algorithm name on an EAGLE-3 draft (SGLang PR 21272);
- tie_word_embeddings (SGLang then uses the embedding as a full-vocabulary head), NaN weights
  (speculators initialises lm_head and the embedding to NaN until the verifier's are loaded),
  an embedding other than the target's (SGLang swaps in the target's, vLLM keeps the draft's).

What each engine reads is transcribed from the pinned wheels' loaders (SGLang 0.5.23
srt/models/llama_eagle3.py + srt/model_executor/model_runner_components/spec_aux_hidden_state.py,
vLLM 0.33.0 model_executor/models/llama_eagle3.py + v1/worker/gpu_model_runner.py +
transformers_utils/configs/speculators/algos.py); what the draft IS comes from this project's
reading of the file (layouts.py, model.py), which reproduces speculators' own forward exactly
(tests/test_speculators_layout.py). With --target the doctor also decodes a few prompts with
speculate.py (fp32: output identical to the target's greedy decoding, accept length in this
project's position convention (which SGLang 0.5.23's worker matches) and one position later, the
--sglang-positions control), measures the draft's
step-0 top-1 agreement with the target, and compares both with the training-time estimate of the
draft's card (training.json) or its run's log.jsonl when one is there.
"""
import json
import math
import os

import torch

from common import UserError
import layouts

SGLANG_V, VLLM_V = "sglang 0.5.23", "vllm 0.33.0"
EAGLE3_CLASSES = {"LlamaForCausalLMEagle3"}                       # SGLang's Llama EAGLE-3 class
EAGLE2_CLASSES = {"LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "LlamaForCausalLM"}
# SGLang's legacy fc_norm tensor names (its loader renames them to fc_norm.{i}; vLLM's does not)
LEGACY_FC_NORM = ("aux_norm_low.weight", "aux_norm_mid.weight", "aux_norm_high.weight")


class Report:
    def __init__(self, out=print):
        self.lines, self.out = [], out

    def add(self, status, field, msg):
        self.lines.append((status, field, msg))
        self.out(f"{status:4s}  {field}: {msg}")

    def ok(self, cond, field, good, bad):
        self.add("PASS" if cond else "FAIL", field, good if cond else bad)
        return cond

    @property
    def failed(self):
        return [ln for ln in self.lines if ln[0] == "FAIL"]


# ----------------------------------------------------------------------------------------------
# What each engine reads from the file (any layout)

def engine_views(d, names, num_layers):
    """{engine: view} for the raw config dict d and tensor names; a view is {"loads": str or None
    (why it cannot load), "layers": output-of-layer ids, "fc_norm", "norm_before_fc",
    "norm_output", "norm_before_residual", "d2t": bool, "tie": bool}. num_layers (the target's)
    resolves the engines' default layers when the file names none; None leaves them unknown."""
    eagle = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    L = num_layers
    views = {}
    # SGLang: no speculators loader; capture ids = eagle_config's i (it adds 1), else (2, L//2, L-3) as k
    if layouts.layout_of(d) == layouts.SPECULATORS:
        arch = (d.get("architectures") or ["?"])[0]
        views[SGLANG_V] = {"loads": f"no SGLang model class for architectures {arch!r} (the "
                                    f"speculators layout): `python model.py DRAFT --export sglang "
                                    f"--out DIR` writes one it loads"}
        tl = d.get("transformer_layer_config") or {}
        ids = d.get("eagle_aux_hidden_state_layer_ids")
        views[VLLM_V] = {
            "loads": None,
            "layers": [k - 1 for k in ids] if ids else (None if L is None else [1, L // 2 - 1, L - 4]),
            # algos.py update_eagle3: top-level flags; norm_before_residual defaults to TRUE there
            "norm_before_residual": bool(d.get("norm_before_residual", True)),
            "norm_before_fc": bool(d.get("norm_before_fc", False)),
            "fc_norm": bool(d.get("fc_norm", False)),
            "norm_output": bool(d.get("norm_output", False)),
            "d2t": "d2t" in names, "tie": bool(tl.get("tie_word_embeddings", False)),
            "num_layers": tl.get("num_hidden_layers", 1)}
        return views
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    views[SGLANG_V] = {
        "loads": None if (d.get("architectures") or [None])[0] in EAGLE3_CLASSES else
        f"architectures {d.get('architectures')} is not {sorted(EAGLE3_CLASSES)}",
        "layers": list(ids) if ids else (None if L is None else [1, L // 2 - 1, L - 4]),
        "norm_before_residual": False,                       # never read
        "norm_before_fc": bool(eagle.get("norm_before_fc", d.get("norm_before_fc", False))),
        "fc_norm": bool(d.get("fc_norm") or d.get("use_aux_norm", False)),
        "norm_output": bool(d.get("norm_output", False)),
        "d2t": "d2t" in names, "tie": bool(d.get("tie_word_embeddings", False)),
        "num_layers": d.get("num_hidden_layers", 1)}
    top = d.get("eagle_aux_hidden_state_layer_ids")
    # gpu_model_runner: the top-level ids, else eagle_config's AS GIVEN; both mean k = input of layer k
    k_ids = top or ids
    views[VLLM_V] = {
        "loads": None,
        "layers": [k - 1 for k in k_ids] if k_ids else (None if L is None else [1, L // 2 - 1, L - 4]),
        "norm_before_residual": bool(d.get("norm_before_residual", False)),
        "norm_before_fc": bool(eagle.get("norm_before_fc", d.get("norm_before_fc", False))),
        "fc_norm": bool(d.get("fc_norm", False)),            # use_aux_norm is SGLang's only
        "norm_output": bool(d.get("norm_output", False)),
        "d2t": "d2t" in names, "tie": False,
        "num_layers": d.get("num_hidden_layers", 1)}
    if any(n in names for n in LEGACY_FC_NORM):
        views[VLLM_V]["legacy_fc_norm"] = True
    return views


# ----------------------------------------------------------------------------------------------
# Static checks: the file, against itself, the target's config, the engines and the run files

def check_static(path, rep, tcfg=None, target_embed=None):
    """Returns the project's DraftConfig when the draft loads, else None."""
    from draft_config import read_config
    layout, d = layouts.read_layout(path)
    tensors = layouts.load_tensors(path)
    names = set(tensors)
    tcfg = getattr(tcfg, "text_config", tcfg)
    L = tcfg.num_hidden_layers if tcfg is not None else None
    rep.add("INFO", "layout", f"{layout}" + (" (speculators_model_type "
            f"{d.get('speculators_model_type')!r}, vLLM detects it by itself)"
            if layout == layouts.SPECULATORS else " (SGLang / SpecForge / EAGLE, LlamaForCausalLMEagle3)"))
    check_algorithm(d, layout, rep)
    cfg, why = None, None
    try:
        cfg = read_config(path)
    except UserError as e:
        why = str(e)
    if not rep.ok(cfg is not None, "config.json", "read as an EAGLE-3 draft", why or ""):
        # what can still be judged from the file alone
        check_partial_rotary(d, layout, rep)
        check_norm_flags(d, layout, names, None, engine_views(d, names, L), rep)
        check_numbers(d, tensors, rep)
        check_tie(d, layout, rep)
        return None
    check_tensors(path, cfg, tensors, rep)
    sd = layouts.sglang_tensors(path, dict(tensors))
    if tcfg is not None:
        check_sizes(cfg, tcfg, rep)
    else:
        rep.add("SKIP", "hidden_size / vocab_size", "no --target to compare with")
    check_layers(cfg, d, layout, L, rep)
    views = engine_views(d, names, L)
    check_engines_layers(cfg, views, rep)
    check_vocab(cfg, sd, rep)
    check_rope(cfg, d, layout, tcfg, rep)
    check_norm_flags(d, layout, names, cfg, views, rep)
    check_window(cfg, rep)
    check_numbers(d, tensors, rep)
    check_tie(d, layout, rep)
    if layout == layouts.SPECULATORS and "embed_tokens.weight" not in tensors:
        rep.add("FAIL", "embed_tokens.weight (speculators 0.9.0)", "absent; expected the target's "
                "embedding: speculators' from_pretrained leaves a missing one uninitialised (not NaN, "
                "so load_verifier_weights does not replace it); `--export speculators --target T` "
                "writes it")
    if layout == layouts.SPECULATORS and not ((d.get("speculators_config") or {}).get(
            "verifier") or {}).get("name_or_path"):
        rep.add("INFO", "speculators_config.verifier.name_or_path", "null: vLLM does not read it; "
                "speculators' own from_pretrained needs it (it loads the verifier's config)")
    if "embed_tokens.weight" in tensors:
        if target_embed is not None:
            e = tensors["embed_tokens.weight"]
            same = tuple(e.shape) == tuple(target_embed.shape) and torch.equal(
                e, target_embed.to(e.dtype))
            rep.ok(same, "embed_tokens.weight", "equals the target's embedding (what SGLang swaps in)",
                   "differs from the target's embedding; expected equal: SGLang swaps in the "
                   "target's, vLLM keeps this one, so the engines run different drafts")
        else:
            rep.add("SKIP", "embed_tokens.weight", "in the checkpoint; no --target to compare with")
    check_run_files(path, cfg, rep)
    return cfg


def check_algorithm(d, layout, rep):
    if layout == layouts.SPECULATORS:
        algo = (d.get("speculators_config") or {}).get("algorithm")
        rep.ok(d.get("speculators_model_type") == "eagle3" and algo == "eagle3",
               "speculators_model_type / speculators_config.algorithm",
               "eagle3 / eagle3 (vLLM: method eagle3)",
               f"{d.get('speculators_model_type')!r} / {algo!r}; expected 'eagle3' for both "
               f"(vLLM takes the method from them: 'eagle' reads no aux layers)")
        return
    arch = d.get("architectures")
    a0 = (arch or [None])[0]
    if a0 in EAGLE3_CLASSES:
        rep.add("PASS", "architectures", f"{arch}: serve with --speculative-algorithm EAGLE3 "
                "(SGLang) / method eagle3 (vLLM); EAGLE would read no aux layers (SGLang PR 21272)")
    else:
        hint = (" (an EAGLE-1/2 or plain Llama class: SGLang would run it as EAGLE without the "
                "captured layers)" if a0 in EAGLE2_CLASSES else "")
        rep.add("FAIL", "architectures", f"{arch}{hint}; expected ['LlamaForCausalLMEagle3']")
    eagle = d.get("eagle_config") or {}
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state", True) is not True:
        rep.add("FAIL", "eagle_config.use_aux_hidden_state",
                f"{eagle.get('use_aux_hidden_state')!r}; expected true (EAGLE-3 reads the target's "
                f"captured layers; false is EAGLE-2)")


def check_tensors(path, cfg, tensors, rep):
    """Every tensor the draft needs, with its shape, and none a loader would skip: what
    Eagle3Draft.from_pretrained refuses (SGLang would silently keep random weights instead).
    Shapes only (a meta-device model), so a large draft costs no memory."""
    from model import Eagle3Draft, read_layout_tensors
    wpath = os.path.join(path, layouts.WEIGHTS_NAME)
    try:
        sd = read_layout_tensors(layouts.sglang_tensors(path, dict(tensors)), cfg, wpath)
    except UserError as e:
        rep.add("FAIL", "tensors", str(e))
        return
    with torch.device("meta"):
        want = {k: v.shape for k, v in Eagle3Draft(cfg).state_dict().items()
                if not k.startswith("rotary.")}
    if "embed_tokens.weight" not in sd:
        want.pop("embed_tokens.weight")       # the target's, swapped in by every loader
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    shapes = [k for k in sorted(set(want) & set(sd)) if tuple(sd[k].shape) != tuple(want[k])]
    if missing or extra:
        rep.add("FAIL", "tensors", f"missing {missing[:3]}, unexpected {extra[:3]}; expected the "
                f"names config.json implies (SGLang leaves a missing tensor random and skips an "
                f"unknown one, silently)")
    elif shapes:
        k = shapes[0]
        rep.add("FAIL", f"tensors: {k}", f"shape {list(sd[k].shape)}; expected {list(want[k])} "
                f"from config.json")
    else:
        rep.add("PASS", "tensors", f"{len(tensors)} tensors, names and shapes as config.json implies")


def check_sizes(cfg, tcfg, rep):
    rep.ok(cfg.target_hidden_size == tcfg.hidden_size, "target_hidden_size",
           f"{cfg.target_hidden_size} = the target's hidden_size",
           f"{cfg.target_hidden_size}; expected the target's hidden_size {tcfg.hidden_size}")
    rep.ok(cfg.hidden_size == tcfg.hidden_size, "hidden_size",
           f"{cfg.hidden_size} = the target's (SGLang swaps in the target's embedding)",
           f"{cfg.hidden_size}; expected the target's {tcfg.hidden_size} (SGLang shares the "
           f"embedding only when they match)")
    rep.ok(cfg.vocab_size == tcfg.vocab_size, "vocab_size", f"{cfg.vocab_size} = the target's",
           f"{cfg.vocab_size}; expected the target's vocab_size {tcfg.vocab_size}")


def check_layers(cfg, d, layout, L, rep):
    ids = list(cfg.aux_layer_ids)
    conv = ("eagle_config ids i = the output of layer i" if layout == layouts.SGLANG else
            "top-level ids k = the input of layer k (speculators / vLLM), read here as i = k - 1")
    rep.ok(len(set(ids)) == len(ids), "aux layers: duplicates", f"{ids} distinct ({conv})",
           f"{ids} repeats a layer; expected distinct ids")
    rep.ok(ids == sorted(ids), "aux layers: order", f"{ids} ascending",
           f"{ids}; expected ascending (SGLang captures layers in ascending order whatever the "
           f"order given, so fc's column blocks would be read in another order)")
    if L is None:
        rep.add("SKIP", "aux layers: range", "no --target to know its number of layers")
    else:
        rep.ok(all(0 <= i <= L - 2 for i in ids), "aux layers: range",
               f"outputs of layers {ids} within [0, {L - 2}] of a {L}-layer target",
               f"{ids}; expected outputs of layers in [0, {L - 2}] for a {L}-layer target (the last "
               f"layer's output is only seen after the final norm)")
    if layout == layouts.SGLANG:
        eagle = d.get("eagle_config") or {}
        top = d.get("eagle_aux_hidden_state_layer_ids")
        if top is None:
            rep.add("FAIL", "eagle_aux_hidden_state_layer_ids (top level)",
                    f"absent; expected {[i + 1 for i in ids]} (vLLM's copy, k = i + 1): without it "
                    f"{VLLM_V} reads eagle_config's {list(eagle.get('eagle_aux_hidden_state_layer_ids') or [])} "
                    f"as input-of-layer ids, one layer early")


def check_engines_layers(cfg, views, rep):
    for eng, v in views.items():
        if v.get("loads"):
            rep.add("INFO", f"{eng}", f"cannot load this layout: {v['loads']}")
            continue
        got = v["layers"]
        rep.ok(got == list(cfg.aux_layer_ids), f"aux layers ({eng})",
               f"captures the outputs of layers {got}, as the draft reads",
               f"captures the outputs of layers {got}; expected {list(cfg.aux_layer_ids)}")
        rep.ok(v["num_layers"] == cfg.num_hidden_layers, f"num_hidden_layers ({eng})",
               f"builds {v['num_layers']} decoder layer(s), as the draft has",
               f"builds {v['num_layers']} decoder layer(s); expected {cfg.num_hidden_layers}")


def check_vocab(cfg, sd, rep):
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    d2t, t2d = sd.get("d2t"), sd.get("t2d")
    if d2t is None:
        rep.add("FAIL" if Vd < V else "PASS", "d2t",
                f"absent with a {Vd}-token draft vocabulary; expected {Vd} offsets: both engines "
                f"would map draft id i to target id i" if Vd < V else "absent, full vocabulary")
        return
    ok = rep.ok(d2t.dtype == torch.long and tuple(d2t.shape) == (Vd,), "d2t: dtype/shape",
                f"int64 [{Vd}]", f"{d2t.dtype} {list(d2t.shape)}; expected int64 [{Vd}]")
    if not ok:
        return
    ids = d2t + torch.arange(Vd)
    in_range = bool(((ids >= 0) & (ids < V)).all())
    distinct = len(set(ids.tolist())) == Vd
    absolute = (bool(((d2t >= 0) & (d2t < V)).all()) and len(set(d2t.tolist())) == Vd
                and Vd < V and (not in_range or not distinct or bool((d2t[1:] > d2t[:-1]).all())
                                and not bool((d2t == 0).all())))
    hint = ("; d2t itself looks like absolute target ids (distinct, ascending, in range): "
            "expected offsets, target id = i + d2t[i]" if absolute and (not in_range or not distinct)
            else f"; expected offsets with every i + d2t[i] a distinct id in [0, {V})")
    rep.ok(in_range, "d2t: offsets in range", f"every i + d2t[i] in [0, {V})",
           f"i + d2t[i] leaves [0, {V}) (e.g. {int(ids.max())}){hint}")
    rep.ok(distinct, "d2t: distinct", f"{Vd} distinct target ids",
           f"{Vd - len(set(ids.tolist()))} repeated target ids{hint}")
    if t2d is None:
        rep.add("INFO", "t2d", "absent (both engines skip it; model.py needs it)")
        return
    if not rep.ok(t2d.dtype == torch.bool and tuple(t2d.shape) == (V,), "t2d: dtype/shape",
                  f"bool [{V}]", f"{t2d.dtype} {list(t2d.shape)}; expected bool [{V}]"):
        return
    agree = in_range and int(t2d.sum()) == Vd and bool(t2d[ids.clamp(0, V - 1)].all())
    extra = ""
    if not agree and absolute and bool(t2d[d2t].all()) and int(t2d.sum()) == Vd:
        extra = "; t2d marks exactly d2t's values, so d2t holds absolute ids: expected offsets (i + d2t[i])"
    rep.ok(agree, "t2d agrees with d2t", f"t2d marks exactly the {Vd} ids i + d2t[i]",
           f"t2d marks {int(t2d.sum())} ids, not the {Vd} ids i + d2t[i]{extra}")


def partial_rotary(d, layout):
    """The partial_rotary_factor the engines read from the draft's config (anywhere), or None."""
    tl = d.get("transformer_layer_config") if layout == layouts.SPECULATORS else d
    tl = tl or {}
    for src in (tl, tl.get("rope_parameters") or {}, tl.get("rope_scaling") or {}):
        if isinstance(src, dict) and src.get("partial_rotary_factor") is not None:
            return src["partial_rotary_factor"]
    return None


def check_partial_rotary(d, layout, rep):
    prf = partial_rotary(d, layout)
    rep.ok(prf in (None, 1, 1.0), "partial_rotary_factor",
           "absent (every engine and this project rotate the whole head)",
           f"{prf}: SGLang and vLLM rotate {prf:.0%} of each head, this project's training and "
           f"speculate.py all of it; expected absent or 1 (speculators issue 613)"
           if isinstance(prf, (int, float)) else f"{prf!r}; expected absent or 1")


def check_rope(cfg, d, layout, tcfg, rep):
    from draft_config import config_from_target
    check_partial_rotary(d, layout, rep)
    if tcfg is None:
        rep.add("SKIP", "rope_theta / rope_scaling / max_position_embeddings",
                "no --target to compare with")
        return
    want = config_from_target(tcfg, cfg.draft_vocab_size, cfg.aux_layer_ids)
    rep.ok(math.isclose(cfg.rope_theta, want.rope_theta), "rope_theta", f"{cfg.rope_theta:g} as "
           f"for this target", f"{cfg.rope_theta:g}; expected {want.rope_theta:g} (the target's)")
    norm = lambda s: None if not s else {k: v for k, v in s.items() if k != "type"} | (
        {"rope_type": s.get("rope_type", s.get("type"))})
    rep.ok(norm(cfg.rope_scaling) == norm(want.rope_scaling), "rope_scaling",
           f"{cfg.rope_scaling} as for this target",
           f"{cfg.rope_scaling}; expected {want.rope_scaling} (from the target's config)")
    rep.ok(cfg.max_position_embeddings >= want.max_position_embeddings, "max_position_embeddings",
           f"{cfg.max_position_embeddings} >= the target's {want.max_position_embeddings}",
           f"{cfg.max_position_embeddings}; expected at least the target's "
           f"{want.max_position_embeddings} (a smaller one wrecked acceptance in public reports)")


def check_window(cfg, rep):
    """Sliding-window attention (speculators' trainer default, window 2048): equal to full
    attention over any context up to the window, which is where this project runs it."""
    W = cfg.sliding_window
    if W is None:
        rep.add("PASS", "attention", "full attention (no sliding window)")
        return
    rep.add("INFO", "sliding_window", f"{W} on every layer: vLLM 0.33.0 applies it (layer_types); "
            f"SGLang 0.5.23 reads no config key for it (serve with --speculative-draft-window-size "
            f"{W}, else it attends past {W} tokens); speculate.py and train.py run this draft only "
            f"on contexts up to {cfg.max_context()} tokens, where it equals full attention")


def check_tie(d, layout, rep):
    rep.ok(not cfg_tie(d, layout), "tie_word_embeddings", "false (lm_head is the draft's own)",
           "true; expected false: SGLang then uses the [V, H] embedding as the head and ignores "
           "lm_head.weight (a different draft)")


def cfg_tie(d, layout):
    if layout == layouts.SPECULATORS:
        return bool((d.get("transformer_layer_config") or {}).get("tie_word_embeddings")
                    or d.get("tie_word_embeddings"))
    return bool(d.get("tie_word_embeddings"))


def check_norm_flags(d, layout, names, cfg, views, rep):
    """Each flag against the tensors and against what each engine reads."""
    n_fc = sum(1 for n in names if n.startswith("fc_norm.") or n in LEGACY_FC_NORM)
    truth = {}
    if cfg is not None:
        truth = {"fc_norm": cfg.fc_norm, "norm_before_fc": cfg.norm_before_fc,
                 "norm_output": cfg.norm_output, "norm_before_residual": cfg.norm_before_residual}
    else:   # the draft did not load: judge the file by its own (SGLang-layout) reading
        try:
            sd = layouts.sglang_config(d)
        except UserError:
            sd = {}
        eagle = sd.get("eagle_config") or {}
        truth = {"fc_norm": bool(sd.get("fc_norm") or sd.get("use_aux_norm")),
                 "norm_before_fc": bool(eagle.get("norm_before_fc", sd.get("norm_before_fc"))),
                 "norm_output": bool(sd.get("norm_output")),
                 "norm_before_residual": bool(d.get("norm_before_residual", False))}
    has = {"fc_norm": n_fc > 0, "norm_before_fc": "input_norm.weight" in names}
    for flag, present in has.items():
        tname = "fc_norm.{i}.weight" if flag == "fc_norm" else "input_norm.weight"
        rep.ok(truth[flag] == present, f"{flag} vs tensors",
               f"{truth[flag]} and {tname} {'present' if present else 'absent'}",
               f"{truth[flag]} but {tname} {'present' if present else 'absent'}; expected "
               f"{'the flag on' if present else 'the tensor'}: "
               + ("the engines skip a norm whose flag is off (SGLang PR 32334)" if present else
                  "the engines would use an all-ones norm"))
    for eng, v in views.items():
        if v.get("loads"):
            continue
        for flag in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"):
            got = v[flag]
            where = {"norm_before_fc": "eagle_config.norm_before_fc, else the top level",
                     "norm_before_residual": ("never read" if eng == SGLANG_V else "top level"
                                              + (", default TRUE" if layout == layouts.SPECULATORS
                                                 else ", default false")),
                     "fc_norm": "fc_norm" + (" or use_aux_norm" if eng == SGLANG_V else
                                             " (not use_aux_norm)"),
                     "norm_output": "top level"}[flag]
            rep.ok(got == truth[flag], f"{flag} ({eng})", f"reads {got} ({where}), as the draft is",
                   f"reads {got} ({where}); expected {truth[flag]}")
        if v.get("legacy_fc_norm"):
            rep.add("FAIL", f"fc_norm tensors ({eng})", "aux_norm_low/mid/high: only SGLang renames "
                    "these; expected fc_norm.{0,1,2}.weight")


def check_numbers(d, tensors, rep):
    fl = {k: v for k, v in tensors.items() if v.is_floating_point()}
    bad = [k for k, v in fl.items() if not bool(torch.isfinite(v).all())]
    rep.ok(not bad, "weights finite", "no NaN or Inf",
           bad and f"{bad[0]} has NaN/Inf (speculators initialises lm_head and embed_tokens to NaN "
           f"until the verifier's weights are loaded); expected finite weights")
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in fl.values()})
    declared = d.get("torch_dtype", d.get("dtype"))
    rep.ok(len(dtypes) == 1 and (declared is None or declared == dtypes[0]), "dtype",
           f"{dtypes[0] if dtypes else '-'} (config.json: {declared})",
           f"tensors {dtypes}, config.json {declared!r}; expected one dtype, the declared one")


def check_run_files(path, cfg, rep):
    """Against what training used, when the run's files are there: a train.py checkpoint
    (RUN/checkpoints/step-N/trainer_state.pt) names its data, whose manifest names the layers."""
    ts = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(ts):
        rep.add("SKIP", "training run files", "no trainer_state.pt next to the draft")
        return
    try:
        state = torch.load(ts, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:   # a corrupt run file is a finding, not a crash
        rep.add("FAIL", "trainer_state.pt", f"unreadable ({type(e).__name__}: {e})")
        return
    args = state.get("args") or {}
    man = os.path.join(str(args.get("data") or ""), "manifest.json")
    if os.path.isfile(man):
        with open(man) as f:
            m = json.load(f)
        rep.ok(list(m.get("aux_layer_ids") or []) == list(cfg.aux_layer_ids),
               "aux layers vs training data", f"{cfg.aux_layer_ids}, as in {man}",
               f"{cfg.aux_layer_ids}; expected {m.get('aux_layer_ids')} (the layers {man} captured)")
    else:
        rep.add("SKIP", "aux layers vs training data", f"the run's data {args.get('data')!r} is not here")
    dc = args.get("draft_config")
    if dc and os.path.isfile(dc):
        with open(dc) as f:
            t = layouts.sglang_config(json.load(f))
        for k in ("rope_theta", "rope_scaling", "max_position_embeddings"):
            if k in t:
                rep.ok(t[k] == getattr(cfg, k), f"{k} vs training", f"{getattr(cfg, k)} as trained",
                       f"{getattr(cfg, k)}; expected {t[k]} ({dc}, the run's --draft-config)")


# ----------------------------------------------------------------------------------------------
# Measured checks, with the target

def card_estimate(path):
    """(chain-3 accept length, step-0 accuracy, source) that training measured, or None."""
    card = os.path.join(path, "training.json")
    if os.path.isfile(card):
        with open(card) as f:
            h = (json.load(f).get("held_out") or {})
        if h.get("replay_accept_3") is not None:
            acc = h.get("acc_j") or [None]
            return float(h["replay_accept_3"]), acc[0], card
    log = os.path.join(path, "..", "..", "log.jsonl")
    if os.path.isfile(log):
        last = None
        with open(log) as f:
            for line in f:
                r = json.loads(line)
                if r.get("split") == "eval" and r.get("replay_accept_3") is not None:
                    last = r
        if last:
            return float(last["replay_accept_3"]), last.get("acc_0"), os.path.normpath(log)
    return None


def step0_agreement(target, draft, prompt_ids, out_ids):
    """Share of generated positions where the draft's step-0 top-1 (row t: target features h_t,
    token x_{t+1}) equals the target's top-1 at t+1, and the share of the target's tokens inside
    the draft vocabulary (coverage)."""
    from speculate import new_target_cache, target_forward
    seq = list(prompt_ids) + list(out_ids)
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits, aux = target_forward(target, ids, new_target_cache(target), draft.config.aux_layer_ids)
        T = len(seq)
        pos = torch.arange(T - 1)[None]
        dl, _ = draft(ids[:, 1:], draft.fuse(aux[None, :T - 1]), pos)
    rows = range(len(prompt_ids) - 1, T - 1)          # rows whose next target token was generated
    d_top = draft.draft_ids[dl[0].argmax(-1)]
    t_top = logits.argmax(-1)
    hit = sum(int(d_top[t] == t_top[t + 1]) for t in rows)
    cov = sum(int(draft.t2d[t_top[t + 1]]) for t in rows)
    return hit, cov, len(rows)


def check_measured(path, target, prompts, rep, stop_ids=(), max_new_tokens=48, steps=3):
    """Decode `prompts` (lists of token ids) with speculate.py in fp32, chain of `steps`."""
    from model import load_draft_for
    from speculate import Speculator, target_generate
    draft = load_draft_for(path, target, torch.float32)
    target = target.float()
    res = {}
    refs = [target_generate(target, ids, max_new_tokens, stop_ids=stop_ids)[0] for ids in prompts]
    # the draft's decode steps at this project's positions, and one position later (the
    # --sglang-positions control; SGLang 0.5.23's own EAGLE3 worker matched the first, round for
    # round, in tests/test_sglang_cpu.py)
    for name, shift in (("this project's positions", False), ("one-later decode positions", True)):
        spec = Speculator(target, draft, steps=steps, topk=1, stop_ids=stop_ids,
                          sglang_positions=shift)
        acc = rounds = same = 0
        for ids, ref in zip(prompts, refs):
            out, s = spec.generate(ids, max_new_tokens)
            same += out == ref
            acc += s["accept_length"] * s["rounds"]
            rounds += s["rounds"]
        res[shift] = acc / max(rounds, 1)
        rep.ok(same == len(prompts), f"lossless ({name})",
               f"{same}/{len(prompts)} outputs identical to the target's greedy decoding (fp32)",
               f"{len(prompts) - same}/{len(prompts)} outputs differ from the target's greedy "
               f"decoding; expected identical")
        rep.add("INFO", f"accept length ({name})", f"{res[shift]:.3f} over {rounds} rounds, chain "
                f"of {steps}, {len(prompts)} prompts x {max_new_tokens} tokens")
    hit = cov = n = 0
    for ids, ref in zip(prompts, refs):
        h, c, k = step0_agreement(target, draft, ids, ref)
        hit, cov, n = hit + h, cov + c, n + k
    agree = hit / max(n, 1)
    rep.add("INFO", "step-0 top-1 agreement", f"{agree:.3f} ({hit}/{n} generated positions)")
    rep.add("INFO", "vocabulary coverage", f"{cov / max(n, 1):.3f} of the target's tokens are in "
            f"the draft vocabulary (an upper bound on the agreement)")
    est = card_estimate(path)
    if est is None:
        rep.add("SKIP", "training-time estimate", "no training.json card or run log.jsonl")
        return res
    al, acc0, src = est
    # a served-right draft keeps most of its training-time gain on new prompts (held-out vs
    # MT-Bench here: 2.28 vs 1.85); a served-wrong one falls to ~1 (the public complaint)
    floor = 1 + 0.5 * (al - 1)
    rep.ok(res[False] >= floor, "accept length vs training", f"{res[False]:.3f} >= {floor:.3f} "
           f"(half the gain of training's {al:.3f}, {src})",
           f"{res[False]:.3f}; expected >= {floor:.3f}, half the gain of training's {al:.3f} "
           f"({src}): the draft is not served as it was trained")
    if acc0 is not None:
        rep.ok(agree >= 0.5 * acc0, "step-0 agreement vs training", f"{agree:.3f} >= half of "
               f"training's acc_0 {acc0:.3f}", f"{agree:.3f}; expected >= {0.5 * acc0:.3f}, half "
               f"of training's acc_0 {acc0:.3f} ({src})")
    return res


# ----------------------------------------------------------------------------------------------

def run(path, target=None, tcfg=None, prompts=None, stop_ids=(), out=print, max_new_tokens=48):
    """All checks; returns the Report. `target` (a loaded model) enables the measured checks,
    `tcfg` (its config, or the target's) the comparisons with the target."""
    rep = Report(out)
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such draft directory")
    if target is not None and tcfg is None:
        tcfg = target.config
    emb = target.get_input_embeddings().weight.detach() if target is not None else None
    cfg = check_static(path, rep, tcfg, emb)
    if target is None:
        rep.add("SKIP", "measured checks", "give --target to decode with it")
    elif cfg is None:
        rep.add("SKIP", "measured checks", "the draft does not load")
    elif not prompts:
        rep.add("SKIP", "measured checks", "no prompts")
    else:
        try:
            check_measured(path, target, prompts, rep, stop_ids, max_new_tokens)
        except UserError as e:   # e.g. a draft that does not fit this target: a finding
            rep.add("FAIL", "measured checks", str(e))
    n = len(rep.failed)
    out(f"{'FAILED' if n else 'OK'}: {n} of {sum(s in ('PASS', 'FAIL') for s, _, _ in rep.lines)} "
        f"checks failed, {sum(s == 'SKIP' for s, _, _ in rep.lines)} skipped")
    return rep


def main(path, target_name=None, trust_remote_code=False, n_prompts=3, max_new_tokens=48):
    """The CLI (python model.py DRAFT --doctor [--target T]): exit 1 on any FAIL."""
    import sys
    target = tcfg = None
    prompts, stop = [], ()
    if target_name:
        from common import chat_prompt_ids, load_target, stop_token_ids
        from speculate import DEFAULT_PROMPTS
        target, tok = load_target(target_name, "float32", "cpu", trust_remote_code)
        prompts = [chat_prompt_ids(tok, p) for p in DEFAULT_PROMPTS[:n_prompts]]
        stop = stop_token_ids(tok, target.config)
    rep = run(path, target, tcfg, prompts, stop, max_new_tokens=max_new_tokens)
    sys.exit(1 if rep.failed else 0)
