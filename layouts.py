"""
The two public EAGLE-3 checkpoint layouts, and the conversion between them.

    SGLang / SpecForge / EAGLE        speculators 0.9.0 (vllm-project), speculators_model_type "eagle3"
    --------------------------        ------------------------------------------------------------
    architectures                     ["LlamaForCausalLMEagle3"]   ["Eagle3DraftModel"]
    the decoder layer's shape         top level (Llama fields)     transformer_layer_config (a LlamaConfig)
    captured target layers            eagle_config ids i:          top-level eagle_aux_hidden_state_layer_ids k:
                                      the OUTPUT of layer i        the INPUT of layer k (vLLM's), k = i + 1
    norm_before_fc                    eagle_config (or top level)  top level
    fc_norm, norm_output              top level                    top level
    norm_before_residual              (not read by SGLang)         top level (vLLM: absent means TRUE)
    RoPE                              rope_theta + rope_scaling    transformer_layer_config.rope_parameters
    dtype                             torch_dtype                  dtype
    decoder layer 0 tensors           midlayer.*                   layers.0.*
    later layer i's pre-attn norm     layers.i.hidden_norm (SGLang) layers.i.input_layernorm
                                      + layers.i.input_layernorm (vLLM; same tensor, model.py writes both)
    vocabulary map                    d2t (offsets), t2d (mask)    the same; absent when Vd == V
    embed_tokens.weight               absent when H == Ht          always written (the target's, frozen)

Both layouts store d2t as offsets (target id = i + d2t[i]): speculators' vocab_mapping.py and
vLLM's compute_logits (`arange + draft_id_to_target_id`) agree with SGLang's `hot_token_id = d2t +
arange`. Sources read: speculators 0.9.0 (models/eagle3/{config,core,model_definitions}.py,
models/utils.py resolve_target_layer_ids, train/vocab_mapping.py), vLLM 0.33.0
(transformers_utils/configs/speculators/algos.py, model_executor/models/{llama,llama_eagle3}.py,
v1/worker/gpu_model_runner.py), SGLang 0.5.23 (srt/models/{llama,llama_eagle3}.py).

Conversion is a pure function of (config.json dict, tensors): nothing is cast, every tensor is
passed through bit for bit. Fields of a speculators config that the SGLang layout has no place for
(the verifier's name, speculative_tokens, speculators_version, LlamaConfig defaults such as
initializer_range) ride along in the SGLang config under "speculators_metadata" (both engines
ignore unknown keys), so speculators -> SGLang -> speculators gives back the same file, field for
field. Every field that changes the draft's math is converted explicitly above, or refused.
"""
import copy
import json
import os
import re

from common import UserError, atomic_write, atomic_write_text, read_json

SGLANG, SPECULATORS = "sglang", "speculators"
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
META_KEY = "speculators_metadata"     # in an SGLang-layout config: what only speculators' holds
SG_META_KEY = "sglang_metadata"      # in a speculators config (extra="allow"): what only SGLang's holds
SPECULATORS_VERSION = "0.9.0"
SPECULATORS_ARCH = "Eagle3DraftModel"

# DraftConfig field (SGLang layout, top level) <-> transformer_layer_config field, same meaning
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "hidden_act",
                "bos_token_id", "eos_token_id", "num_hidden_layers", "model_type",
                "tie_word_embeddings", "attention_bias", "mlp_bias")
# speculators top-level field <-> SGLang top-level field, same meaning
TOP_FIELDS = ("draft_vocab_size", "fc_norm", "norm_output")
# transformer_layer_config keys that never change the draft (LlamaConfig bookkeeping). Any other
# key is copied to the SGLang layout's top level, where model.py applies it or refuses it by name.
LAYER_INERT = {"attention_dropout", "initializer_range", "pad_token_id", "pretraining_tp",
               "use_cache", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
               "architectures", "rope_parameters", "output_attentions", "output_hidden_states",
               "return_dict"}
# every top-level key of a speculators eagle3 config this file understands; others are refused
SPECULATORS_KEYS = {"architectures", "auto_map", "draft_vocab_size", "dtype", "torch_dtype",
                    "eagle_aux_hidden_state_layer_ids", "embed_requires_grad", "fc_norm",
                    "norm_before_fc", "norm_before_residual", "norm_output", "speculators_config",
                    "speculators_model_type", "speculators_version", "target_hidden_size",
                    "tie_word_embeddings", "transformer_layer_config", "transformers_version",
                    "_name_or_path", "sglang_metadata"}


def layout_of(d):
    """Which layout a config.json dict is in."""
    return SPECULATORS if "speculators_model_type" in d else SGLANG


def read_layout(path):
    """(layout, raw config dict) of a draft directory."""
    cpath = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cpath):
        raise UserError(f"{path}: no {CONFIG_NAME}; expected an EAGLE-3 draft directory")
    d = read_json(cpath)
    return layout_of(d), d


# ----------------------------------------------------------------------------------------------
# speculators -> SGLang

def rope_from_parameters(rp, where):
    """transformer_layer_config.rope_parameters -> (rope_theta, rope_scaling) as model.py keeps
    them: rope_scaling None for plain RoPE, else the parameters without rope_theta."""
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        raise UserError(f"{where}: transformer_layer_config.rope_parameters must be an object with "
                        f"rope_theta, got {rp!r}")
    kind = rp.get("rope_type", rp.get("type", "default"))
    extra = sorted(set(rp) - {"rope_theta", "rope_type", "type"})
    if kind == "default" and extra:
        raise UserError(f"{where}: transformer_layer_config.rope_parameters has {extra[0]!r} with "
                        f"plain RoPE: this project does not apply it (the engines do)")
    return float(rp["rope_theta"]), (None if kind == "default" else
                                     {k: v for k, v in rp.items() if k != "rope_theta"})


def vllm_ids_to_sglang(ids, where):
    """speculators' / vLLM's layer ids k (input of layer k; 0 = the embeddings, L = the final
    pre-norm state) -> SGLang's i = k - 1 (output of layer i)."""
    if not isinstance(ids, list) or not ids or not all(isinstance(k, int) for k in ids):
        raise UserError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer ids "
                        f"(speculators' convention: the input of layer k), got {ids!r}; when it is "
                        f"absent vLLM picks the target's default (2, L//2, L-3): write it explicitly")
    if min(ids) < 1:
        raise UserError(f"{where}: eagle_aux_hidden_state_layer_ids {ids}: k = 0 (the embeddings) "
                        f"is not an output of any decoder layer; this project captures layers")
    return [k - 1 for k in ids]


def speculators_to_sglang_config(d, where=CONFIG_NAME, meta=True):
    """A speculators eagle3 config.json dict -> the SGLang-layout dict model.py reads. With meta,
    the fields only one layout holds are carried across (module docstring), for exact round trips."""
    if d.get("speculators_model_type") != "eagle3":
        raise UserError(f"{where}: speculators_model_type {d.get('speculators_model_type')!r}: only "
                        f"'eagle3' is an EAGLE-3 draft")
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise UserError(f"{where}: transformer_layer_config must be an object (the decoder layer's "
                        f"LlamaConfig)")
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size", "rope_parameters")
               if k not in tl]
    if missing or "draft_vocab_size" not in d:
        raise UserError(f"{where}: not a speculators eagle3 config (missing "
                        f"{(missing or ['draft_vocab_size'])[0]})")
    unknown = sorted(set(d) - SPECULATORS_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r} in a speculators eagle3 config: this "
                        f"project does not apply it")
    out = {"architectures": ["LlamaForCausalLMEagle3"]}
    for k in tl:
        if k not in LAYER_INERT:
            out[k] = tl[k]
    out.setdefault("head_dim", tl["hidden_size"] // tl["num_attention_heads"])
    out["rope_theta"], out["rope_scaling"] = rope_from_parameters(tl["rope_parameters"], where)
    for k in TOP_FIELDS:
        if k in d:
            out[k] = d[k]
    ths = d.get("target_hidden_size")
    out["target_hidden_size"] = tl["hidden_size"] if ths is None else ths
    # vLLM reads norm_before_residual from a speculators config with default TRUE (algos.py);
    # speculators' own default is false. Absent is therefore ambiguous: refuse it.
    if "norm_before_residual" not in d:
        raise UserError(f"{where}: norm_before_residual is absent: speculators reads that as false, "
                        f"vLLM 0.33.0 as true; write it explicitly")
    if d["norm_before_residual"] is not False:
        out["norm_before_residual"] = d["norm_before_residual"]   # vLLM only: SGLang never reads it
    if d.get("tie_word_embeddings"):
        out["tie_word_embeddings"] = d["tie_word_embeddings"]
    dtype = d.get("dtype", d.get("torch_dtype", tl.get("dtype")))
    if dtype is not None:
        out["torch_dtype"] = dtype
    ids = vllm_ids_to_sglang(d.get("eagle_aux_hidden_state_layer_ids"),
                             f"{where}: eagle_aux_hidden_state_layer_ids")
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True,
                           "norm_before_fc": bool(d.get("norm_before_fc", False))}
    out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]   # vLLM's copy
    if not meta:
        return out
    if d.get(SG_META_KEY):
        out = patch(out, d[SG_META_KEY])
    # what the SGLang layout cannot hold, so that the way back is exact
    m = diff(without(d, SG_META_KEY), sglang_to_speculators_config(out, meta=False))
    if m:
        out[META_KEY] = m
    return out


def without(d, key):
    return {k: v for k, v in d.items() if k != key}


def layer_index(name):
    m = re.match(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def speculators_to_sglang_tensors(sd, cfg_out, d=None):
    """layers.0.* -> midlayer.*; a later layer's input_layernorm is also its hidden_norm (SGLang
    reads hidden_norm there); d2t/t2d made explicit (identity) when the draft vocab is the full
    vocabulary, since model.py always stores them; the target's embedding dropped again when an
    export added it (sglang_metadata.absent_tensors). No tensor is changed."""
    out = {}
    drop = set(((d or {}).get(SG_META_KEY) or {}).get("absent_tensors") or [])
    for k, v in sd.items():
        if k in drop:
            continue
        i = layer_index(k)
        if i == 0:
            out["midlayer." + k[len("layers.0."):]] = v
        else:
            out[k] = v
            if i is not None and k == f"layers.{i}.input_layernorm.weight":
                out[f"layers.{i}.hidden_norm.weight"] = v.clone()   # safetensors: no shared storage
    V, Vd = cfg_out["vocab_size"], cfg_out["draft_vocab_size"]
    if Vd == V and "d2t" not in out and "t2d" not in out:
        import torch
        out["d2t"] = torch.zeros(Vd, dtype=torch.long)
        out["t2d"] = torch.ones(V, dtype=torch.bool)
    return out


# ----------------------------------------------------------------------------------------------
# SGLang -> speculators

def sglang_to_speculators_config(d, meta=True, verifier=None, speculative_tokens=3):
    """An SGLang-layout config.json dict (as model.py writes it) -> speculators' eagle3 dict.
    With meta, the fields carried in speculators_metadata (from an earlier conversion) are put back."""
    eagle = d.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    tl = {k: d[k] for k in LAYER_FIELDS if k in d}
    rp = {"rope_theta": d.get("rope_theta", 10000.0)}
    rp.update(d.get("rope_scaling") or {"rope_type": "default"})
    tl["rope_parameters"] = rp
    # the LlamaConfig fields speculators writes besides the shape (transformers' defaults)
    for k, v in (("attention_dropout", 0.0), ("initializer_range", 0.02), ("pad_token_id", None),
                 ("pretraining_tp", 1), ("use_cache", True)):
        tl.setdefault(k, v)
    out = {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens, "verifier_accept_k": 1}],
            "verifier": {"architectures": list((verifier or {}).get("architectures") or []),
                         "name_or_path": (verifier or {}).get("name_or_path")}},
        "transformer_layer_config": tl,
        "draft_vocab_size": d.get("draft_vocab_size"),
        "target_hidden_size": d.get("target_hidden_size"),
        # speculators' convention: the input of layer k = the output of SGLang's layer i = k - 1
        "eagle_aux_hidden_state_layer_ids": None if ids is None else [i + 1 for i in ids],
        "norm_before_residual": bool(d.get("norm_before_residual", False)),
        "norm_before_fc": bool(eagle.get("norm_before_fc", d.get("norm_before_fc", False))),
        "fc_norm": bool(d.get("fc_norm", False)),
        "norm_output": bool(d.get("norm_output", False)),
        "embed_requires_grad": False,
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
    }
    if "torch_dtype" in d:
        out["dtype"] = d["torch_dtype"]
    if not meta:
        return out
    if d.get(META_KEY):
        out = patch(out, d[META_KEY])
    m = diff(without(d, META_KEY), speculators_to_sglang_config(out, meta=False))
    if m:
        out[SG_META_KEY] = m
    return out


def sglang_to_speculators_tensors(sd, cfg):
    """midlayer.* -> layers.0.*; a later layer keeps only input_layernorm (speculators' plain Llama
    layer; model.py has checked it equals hidden_norm); no d2t/t2d for a full draft vocabulary."""
    out = {}
    for k, v in sd.items():
        if k.startswith("midlayer."):
            out["layers.0." + k[len("midlayer."):]] = v
        elif layer_index(k) and k.endswith(".hidden_norm.weight"):
            continue
        else:
            out[k] = v
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:
        out.pop("d2t", None)
        out.pop("t2d", None)
    return out


# ----------------------------------------------------------------------------------------------
# Exact round trips: the metadata is a diff of nested dicts

NESTED = ("transformer_layer_config", "speculators_config", "eagle_config")


def split_path(path):
    head, _, tail = path.partition(".")
    return (head, tail) if head in NESTED and tail else (None, path)


def diff(full, base):
    """What to apply to `base` to get `full`: {"set": {path: value}, "unset": [path]}, a path
    being a top-level key or NESTED.KEY."""
    sets, unsets = {}, []
    for k in sorted(set(full) | set(base)):
        a, b = full.get(k, _MISSING), base.get(k, _MISSING)
        if k in NESTED and isinstance(a, dict) and isinstance(b, dict):
            for kk in sorted(set(a) | set(b)):
                if a.get(kk, _MISSING) != b.get(kk, _MISSING):
                    if kk in a:
                        sets[f"{k}.{kk}"] = a[kk]
                    else:
                        unsets.append(f"{k}.{kk}")
        elif a != b:
            if a is _MISSING:
                unsets.append(k)
            else:
                sets[k] = a
    return {**({"set": sets} if sets else {}), **({"unset": unsets} if unsets else {})}


def patch(d, meta):
    """Apply a diff() to a copy of d."""
    d = copy.deepcopy(d)
    for path, v in (meta.get("set") or {}).items():
        head, key = split_path(path)
        (d.setdefault(head, {}) if head else d)[key] = copy.deepcopy(v)
    for path in meta.get("unset") or []:
        head, key = split_path(path)
        (d.get(head, {}) if head else d).pop(key, None)
    return d


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


# ----------------------------------------------------------------------------------------------
# The hooks model.py calls, and the export

def sglang_config(d, where=CONFIG_NAME):
    """Any layout's config.json dict -> the SGLang-layout dict DraftConfig.from_json reads
    (speculators_metadata dropped: it never changes the draft)."""
    if layout_of(d) == SPECULATORS:
        d = speculators_to_sglang_config(d, where)
    return without(d, META_KEY)


def sglang_tensors(path, sd):
    """The tensors of draft directory `path` in the SGLang layout's names."""
    layout, d = read_layout(path)
    if layout == SPECULATORS:
        return speculators_to_sglang_tensors(sd, speculators_to_sglang_config(d, path), d)
    return sd


def convert(d, sd, to, where=CONFIG_NAME, verifier=None, embed=None):
    """(config dict, tensors) in either layout -> the same draft in layout `to`. `embed` (the
    target's embedding) is written into a speculators checkpoint that has none: speculators
    0.9.0's from_pretrained leaves a missing embed_tokens.weight uninitialised (empty memory, not
    the NaN its load_verifier_weights looks for), so its own checkpoints always carry one."""
    src = layout_of(d)
    if src == SPECULATORS:
        d2 = speculators_to_sglang_config(d, where)
        sd = speculators_to_sglang_tensors(sd, d2, d)
        d = d2
    if to == SGLANG:
        return d, sd
    d_out, sd_out = sglang_to_speculators_config(d, verifier=verifier), sglang_to_speculators_tensors(sd, d)
    if "embed_tokens.weight" not in sd_out:
        if embed is None:
            raise UserError(f"{where}: no embed_tokens.weight (the target's, not saved when H == Ht); "
                            f"speculators 0.9.0 would load it uninitialised: give --target to "
                            f"write the target's embedding into the speculators checkpoint")
        want = (d.get("vocab_size"), d.get("hidden_size"))
        if tuple(embed.shape) != want:
            raise UserError(f"--target: embedding {list(embed.shape)}, this draft needs {list(want)}")
        sd_out["embed_tokens.weight"] = embed.to(sd["lm_head.weight"].dtype).contiguous()
        meta = dict(d_out.get(SG_META_KEY) or {})
        meta["absent_tensors"] = ["embed_tokens.weight"]
        d_out[SG_META_KEY] = meta
    return d_out, sd_out


def load_tensors(path):
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    wpath = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(wpath):
        raise UserError(f"{path}: no {WEIGHTS_NAME}")
    try:
        return load_file(wpath)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{wpath}: unreadable safetensors file ({e})")


def export(src, to, out, verifier=None, embed=None):
    """Write draft `src` (either layout) to directory `out` in layout `to`, after checking that
    converting the result back gives exactly the source (tensors bit for bit, config field for
    field). Returns the written config dict."""
    import torch
    from safetensors.torch import save_file
    if to not in (SGLANG, SPECULATORS):
        raise UserError(f"--export {to}: expected {SGLANG} or {SPECULATORS}")
    if os.path.abspath(src) == os.path.abspath(out):
        raise UserError(f"--out {out}: is the source draft; choose another directory")
    _, d = read_layout(src)
    sd = load_tensors(src)
    d_out, sd_out = convert(d, sd, to, os.path.join(src, CONFIG_NAME), verifier, embed)
    # the way back must give the source again (same layout as the source)
    d_back, sd_back = convert(d_out, sd_out, layout_of(d), embed=sd.get("embed_tokens.weight"))
    bad = [k for k in sorted(set(sd) | set(sd_back))
           if k not in sd or k not in sd_back or sd[k].dtype != sd_back[k].dtype
           or not torch.equal(sd[k], sd_back[k])]
    # (speculators_metadata only records the verifier named with --target, never the draft)
    d, d_back = ({k: v for k, v in x.items() if k != META_KEY} for x in (d, d_back))
    if d_back != d or bad:
        field = next((k for k in sorted(set(d) | set(d_back)) if d.get(k) != d_back.get(k)), None)
        raise UserError(f"{src}: the {to} layout cannot hold this draft exactly (differs in "
                        f"{'config field ' + repr(field) if field else 'tensor ' + repr(bad[0])})")
    os.makedirs(out, exist_ok=True)
    sd_out = {k: v.contiguous() for k, v in sd_out.items()}
    atomic_write(os.path.join(out, WEIGHTS_NAME),
                 lambda p: save_file(sd_out, p, metadata={"format": "pt"}))
    atomic_write_text(os.path.join(out, CONFIG_NAME), json.dumps(d_out, indent=2) + "\n")
    return d_out
