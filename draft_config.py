"""
The draft's config.json: what each key means, and the draft config made for a target.

`DraftConfig` is the draft's shape and layout (model.py's module docstring has the math of each
layout option). A config.json is read with the keys both engines read, in either public layout
(layouts.py turns speculators' into SGLang's first), and **a key this project does not apply is an
error, never ignored**: SGLang or vLLM would apply it, so ignoring it would train or decode a
different draft than the one served. `config_from_target` makes the default draft for a target
(its width, heads, RoPE, the three captured layers), `apply_draft_config` applies a user's
`--draft-config` on top of it, `check_fits` / `check_aux_layers` check a draft against a target.
"""
import os
from dataclasses import asdict, dataclass, field

from common import UserError, read_json

CONFIG_NAME = "config.json"


# ----------------------------------------------------------------------------------------------
# Config

@dataclass
class DraftConfig:
    hidden_size: int                 # H, the draft's width (= target's in every public config)
    intermediate_size: int           # MLP width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                  # target vocabulary V (the embedding's rows)
    draft_vocab_size: int            # Vd, rows of lm_head
    target_hidden_size: int          # Ht, width of each captured target hidden state
    aux_layer_ids: list = field(default_factory=list)  # output of target decoder layer i (0-based)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = None        # as in the target config (llama3, yarn, ...), None = plain
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    bos_token_id: int = None
    eos_token_id: object = None
    torch_dtype: str = "bfloat16"
    # layout options (module docstring), all off = the original one-layer EAGLE-3 draft
    num_hidden_layers: int = 1
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False   # vLLM only (SGLang 0.5.23 never reads it)
    # speculators' trainer default: sliding-window attention (layer_types "sliding_attention").
    # Over a context of at most W tokens that is full attention exactly, so this project runs such
    # a draft only there: max_context() caps every prompt + answer and training sequence at W.
    sliding_window: int = None

    def max_context(self):
        """The longest context this draft is run on: its positions, or its sliding window."""
        W = self.sliding_window
        return self.max_position_embeddings if W is None else min(W, self.max_position_embeddings)

    def to_sglang_json(self):
        """The config.json that SGLang's LlamaForCausalLMEagle3 loader reads."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": self.num_hidden_layers,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            # SGLang reads eagle_config's ids and captures the input of layer i+1 (= output of
            # layer i). vLLM (0.33.0, checked in tests/test_engine_checkpoints.py) reads a top-level
            # key first and captures the input of layer k as given: the same layers are k = i+1.
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.aux_layer_ids],
        }
        for k, v in asdict(self).items():
            if k not in ("aux_layer_ids", "sliding_window") and k not in ALL_FLAGS:
                d[k] = v
        if self.sliding_window is not None:   # as speculators writes it; vLLM reads layer_types
            d.update(use_sliding_window=True, sliding_window=self.sliding_window,
                     layer_types=["sliding_attention"] * self.num_hidden_layers)
        # layout flags only when on (a default draft's config stays as it always was): fc_norm
        # and norm_output at the top level, norm_before_fc in eagle_config (both engines read
        # it there first)
        for k in ("fc_norm", "norm_output", "norm_before_residual"):
            if getattr(self, k):
                d[k] = True
        if self.norm_before_fc:
            d["eagle_config"]["norm_before_fc"] = True
        return d

    @classmethod
    def from_json(cls, d, where=CONFIG_NAME):
        eagle = d.get("eagle_config")
        if (eagle is None or isinstance(eagle, dict)) and not (eagle or {}).get(
                "eagle_aux_hidden_state_layer_ids"):
            # the original EAGLE-3 release files carry no layer ids: each engine then picks its own
            # default layers of the target, which need not be the ones the draft was trained on
            raise UserError(f"{where}: no eagle_config.eagle_aux_hidden_state_layer_ids; expected the "
                            f"captured target layers (output of layer i, 0-based; SGLang's default "
                            f"for an L-layer target is [1, L//2-1, L-4]) written there")
        try:
            layers = d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            vllm = d.get("eagle_aux_hidden_state_layer_ids")  # vLLM's convention: i + 1
            if vllm is not None and list(vllm) != [i + 1 for i in layers]:
                raise UserError(f"{where}: eagle_aux_hidden_state_layer_ids {vllm} (vLLM, input of "
                                f"layer k) and eagle_config's {layers} (SGLang, output of layer i) "
                                f"name different layers; expected k = i + 1")
            d = normalize_config_keys(d, where)
            kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "aux_layer_ids"}
            if "head_dim" not in kw:
                kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
            kw.setdefault("target_hidden_size", d["hidden_size"])
            return cls(aux_layer_ids=list(layers), **kw)
        except (KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{where}: not an EAGLE-3 draft config (missing or bad field {e})")


# ----------------------------------------------------------------------------------------------
# Which config.json keys mean what. A key this project does not apply is an error, never ignored:
# SGLang or vLLM would apply it, so ignoring it would train or decode a different draft.

# The layout options and where each engine reads them (module docstring)
LAYOUT_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")
# vLLM 0.33.0 reads one more (top level): norm_before_residual, layer 0's residual is hidden_norm(g)
# instead of g (speculators' trainer default). SGLang 0.5.23 never reads it, so such a draft is
# served right only by vLLM (doctor.py says so).
VLLM_ONLY_FLAGS = ("norm_before_residual",)
ALL_FLAGS = LAYOUT_FLAGS + VLLM_ONLY_FLAGS
# Keys that leave the draft's math unchanged (metadata, or options of the target's own config
# that a draft never uses); read and dropped.
INERT_KEYS = {"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
              "initializer_range", "pretraining_tp", "use_cache", "pad_token_id",
              "attention_dropout", "max_window_layers", "output_attentions",
              "output_hidden_states", "return_dict", "target_layer_count",
              "speculators_metadata"}   # layouts.py: a speculators file's bookkeeping, kept for
                                        # the way back (verifier name, version, ...)
# Keys with the one value this draft implements; any other value is refused.
FIXED_KEYS = {"model_type": "llama", "hidden_act": "silu", "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "bias": False, "logit_scale": 1.0,
              "quantization_config": None}
EAGLE_CONFIG_KEYS = {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc"}
# the rest: DraftConfig's fields, eagle_config, the vLLM copy of the layer ids, and these
OTHER_KEYS = {"eagle_config", "eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states",
              "use_aux_norm", "rope_parameters", "layer_types", "use_sliding_window"}


def normalize_config_keys(d, where):
    """A config.json dict -> the same dict with every key this project knows in DraftConfig's
    terms (norm_before_fc taken from eagle_config or the top level as both engines do, fc_norm
    from its legacy name use_aux_norm, rope_parameters split into rope_theta/rope_scaling), after
    checking that no key asks for something the draft does not do."""
    d = dict(d)
    known = set(DraftConfig.__dataclass_fields__) | INERT_KEYS | set(FIXED_KEYS) | OTHER_KEYS
    unknown = sorted(set(d) - (known - {"aux_layer_ids"}))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}: this project does not apply it "
                        f"(known layout options: {', '.join(LAYOUT_FLAGS)}, num_hidden_layers)")
    for k, want in FIXED_KEYS.items():
        if k in d and d[k] != want:
            raise UserError(f"{where}: {k} is {d[k]!r}; this draft implements only {want!r}")
    # sliding window: vLLM reads layer_types (transformers' Llama too); use_sliding_window is the
    # older switch, read only without layer_types. Sliding means the window in sliding_window, on
    # every layer (the only case implemented); otherwise sliding_window is a leftover of the Llama
    # config and means nothing.
    types = d.pop("layer_types", None) or []
    if any(t not in ("full_attention", "sliding_attention") for t in types) or len(set(types)) > 1:
        raise UserError(f"{where}: layer_types {types}: expected all full_attention or all "
                        f"sliding_attention")
    W = d.pop("sliding_window", None)
    switch = d.pop("use_sliding_window", False)
    if "sliding_attention" in types or (switch and not types):
        if not (isinstance(W, int) and not isinstance(W, bool) and W >= 1):
            raise UserError(f"{where}: sliding attention with sliding_window {W!r}; expected a "
                            f"positive integer")
        d["sliding_window"] = W
    eagle = d.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise UserError(f"{where}: eagle_config must be an object, got {eagle!r}")
    bad = sorted(set(eagle) - EAGLE_CONFIG_KEYS)
    if bad:
        raise UserError(f"{where}: unknown eagle_config key {bad[0]!r}: this project does not apply it")
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise UserError(f"{where}: eagle_config.use_aux_hidden_state must be true (EAGLE-3 reads "
                        f"the target's captured layers through fc)")
    # both engines: eagle_config's norm_before_fc, else the top-level one; fc_norm or use_aux_norm
    if "norm_before_fc" in eagle:
        d["norm_before_fc"] = eagle["norm_before_fc"]
    if "use_aux_norm" in d:
        d["fc_norm"] = bool(d.get("fc_norm")) or d.pop("use_aux_norm")
    for k in ALL_FLAGS:
        if k in d and not isinstance(d[k], bool):
            raise UserError(f"{where}: {k} must be true or false, got {d[k]!r}")
    n = d.get("num_hidden_layers", 1)
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise UserError(f"{where}: num_hidden_layers must be a positive integer, got {n!r}")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    na = d.pop("num_aux_hidden_states", None)
    if na is not None and ids is not None and na != len(ids):
        raise UserError(f"{where}: num_aux_hidden_states {na} but {len(ids)} "
                        f"eagle_aux_hidden_state_layer_ids {ids}")
    # transformers 5 writes RoPE as rope_parameters; older files as rope_theta + rope_scaling
    rp = d.pop("rope_parameters", None)
    if isinstance(rp, dict):
        d.setdefault("rope_theta", rp.get("rope_theta"))
        kind = rp.get("rope_type", rp.get("type", "default"))
        d.setdefault("rope_scaling", None if kind == "default" else
                     {k: v for k, v in rp.items() if k != "rope_theta"})
    return d


def default_aux_layers(num_layers):
    """Low, middle, high: the outputs of decoder layers 1, L//2-1 and L-4 (reference §2).

    Usable ids are 0..L-2 (layer L-1's output is only seen after the final norm). For L >= 7 the
    rule gives three distinct ids; below that it repeats a layer (L = 6: [1, 2, 2]), so small
    targets get the lowest, middle and highest usable layers instead: [0, (L-2)//2, L-2]. Three
    distinct ids need at least 3 usable layers, i.e. L >= 4."""
    L = num_layers
    if L < 4:
        raise UserError(f"target has {L} layers: EAGLE-3 captures three distinct layers among "
                        f"the {max(L - 1, 0)} usable ones (0..L-2), which needs at least 4 layers")
    ids = [1, L // 2 - 1, L - 4]
    if not ids[0] < ids[1] < ids[2]:
        ids = [0, (L - 2) // 2, L - 2]
    return ids


def is_mla(tcfg):
    """DeepSeek-V2/V3-style multi-head latent attention (DeepSeek-V3, Kimi-K2): keys and values
    come from a compressed latent (kv_lora_rank) and RoPE acts on a separate qk_rope_head_dim slice."""
    return getattr(tcfg, "kv_lora_rank", None) is not None


# Draft RoPE for MLA targets, as in the public Kimi-K2 drafts. The target's own RoPE (YaRN on a
# 64-dim slice of each head, original context 4096) has no counterpart in a Llama layer with
# 128-dim heads, so the draft gets plain RoPE with a base large enough for 128k positions.
MLA_DRAFT_ROPE_THETA = 1e6


def config_from_target(tcfg, draft_vocab_size=None, aux_layer_ids=None):
    """A draft config for a target config.

    Llama-like targets (Llama, Qwen, Mistral, ...): every shape and RoPE setting is copied.
    MLA targets (DeepSeek-V3, Kimi-K2): a Llama layer cannot copy MLA's head dims, so the draft
    takes the shape of the public Kimi-K2 drafts: width H = Ht, one head per target head
    (num_attention_heads) as plain multi-head attention (kv heads = heads), head_dim = the
    target's v_head_dim (128), MLP width = the target's dense MLP (intermediate_size, not the
    MoE experts' moe_intermediate_size), plain RoPE with theta 1e6 and no scaling, and the
    target's max_position_embeddings. For Kimi-K2: 7168 wide, 64 x 128 heads, MLP 18432."""
    tcfg = getattr(tcfg, "text_config", tcfg)  # multimodal wrappers keep the LM config inside
    L = tcfg.num_hidden_layers
    if aux_layer_ids is None:
        aux_layer_ids = default_aux_layers(L)
    H = tcfg.hidden_size
    nh = tcfg.num_attention_heads
    # transformers 5 keeps RoPE settings in `rope_parameters`; older configs in rope_theta/rope_scaling
    rope = dict(getattr(tcfg, "rope_parameters", None) or getattr(tcfg, "rope_scaling", None) or {})
    rope_theta = rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None if rope_type == "default" else {k: v for k, v in rope.items()
                                                        if k != "rope_theta"}
    nkv = getattr(tcfg, "num_key_value_heads", None) or nh
    head_dim = getattr(tcfg, "head_dim", None) or H // nh
    if is_mla(tcfg):
        nkv, head_dim = nh, tcfg.v_head_dim
        rope_theta, rope_scaling = MLA_DRAFT_ROPE_THETA, None
    eos = tcfg.eos_token_id
    return DraftConfig(
        hidden_size=H, intermediate_size=tcfg.intermediate_size, num_attention_heads=nh,
        num_key_value_heads=nkv, head_dim=head_dim,
        vocab_size=tcfg.vocab_size,
        draft_vocab_size=draft_vocab_size or tcfg.vocab_size,
        target_hidden_size=H, aux_layer_ids=list(aux_layer_ids),
        rms_norm_eps=tcfg.rms_norm_eps, rope_theta=float(rope_theta), rope_scaling=rope_scaling,
        max_position_embeddings=tcfg.max_position_embeddings,
        bos_token_id=tcfg.bos_token_id, eos_token_id=eos,
    )


# Fields of an explicit draft config (--draft-config, like SpecForge's --draft-model-config) that
# may differ from the automatic choice. The rest is fixed by the target and the data.
SHAPE_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
                "num_hidden_layers", "sliding_window") + ALL_FLAGS


def apply_draft_config(cfg, path, flag="--draft-config"):
    """Override cfg's shape and layout with a JSON draft config (e.g. a public draft's
    config.json). Fields that must agree with the target or data (hidden_size, vocab_size,
    draft_vocab_size, target_hidden_size, aux layers) are checked, not taken; a key the draft
    does not apply is an error (normalize_config_keys)."""
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise UserError(f"{flag} {path}: expected a JSON object")
    d = normalize_config_keys(raw, f"{flag} {path}")
    fixed = {"hidden_size": cfg.hidden_size, "target_hidden_size": cfg.target_hidden_size,
             "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size}
    for k, want in fixed.items():
        if k in d and d[k] != want:
            raise UserError(f"{flag} {path}: {k} is {d[k]!r}, but this draft needs {want!r} "
                            f"(set by the target or the data)")
    layers = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layers is not None and list(layers) != list(cfg.aux_layer_ids):
        raise UserError(f"{flag} {path}: eagle_aux_hidden_state_layer_ids {layers} differ from the "
                        f"layers {cfg.aux_layer_ids} this draft reads (--aux-layers / the data)")
    vllm = d.get("eagle_aux_hidden_state_layer_ids")   # vLLM's copy: input of layer i + 1
    if vllm is not None and list(vllm) != [i + 1 for i in cfg.aux_layer_ids]:
        raise UserError(f"{flag} {path}: top-level eagle_aux_hidden_state_layer_ids {vllm} (vLLM: "
                        f"input of layer k = i + 1) do not name the layers {cfg.aux_layer_ids}")
    na = raw.get("num_aux_hidden_states")
    if na is not None and na != len(cfg.aux_layer_ids):
        raise UserError(f"{flag} {path}: num_aux_hidden_states {na}, but this draft reads "
                        f"{len(cfg.aux_layer_ids)} layers {cfg.aux_layer_ids}")
    kw = {k: d[k] for k in SHAPE_FIELDS if k in d and (d[k] is not None or k == "rope_scaling")}
    if "head_dim" not in kw and "num_attention_heads" in kw:
        kw["head_dim"] = cfg.hidden_size // kw["num_attention_heads"]
    for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings"):
        if k in kw and not (isinstance(kw[k], int) and kw[k] > 0):
            raise UserError(f"{flag} {path}: {k} must be a positive integer, got {kw[k]!r}")
    out = DraftConfig(**{**asdict(cfg), **kw})
    if out.num_attention_heads % out.num_key_value_heads:
        raise UserError(f"{flag} {path}: num_attention_heads {out.num_attention_heads} is not a "
                        f"multiple of num_key_value_heads {out.num_key_value_heads}")
    if out.head_dim % 2:
        raise UserError(f"{flag} {path}: head_dim {out.head_dim} must be even (RoPE rotates pairs)")
    return out


def check_fits(cfg, tcfg, where="draft"):
    """Raise a UserError naming the first way a draft does not fit a target config."""
    tcfg = getattr(tcfg, "text_config", tcfg)
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise UserError(f"{where}: target_hidden_size {cfg.target_hidden_size} does not match the "
                        f"target's hidden_size {tcfg.hidden_size}")
    if cfg.vocab_size != tcfg.vocab_size:
        raise UserError(f"{where}: vocab_size {cfg.vocab_size} does not match the target's "
                        f"vocab_size {tcfg.vocab_size}")
    L = tcfg.num_hidden_layers
    check_aux_layers(cfg.aux_layer_ids, L, f"{where}: eagle_aux_hidden_state_layer_ids")


def check_aux_layers(ids, num_layers, where):
    """Captured layers: at least two (with one, SGLang's width test `hidden.shape[-1] != H` would
    skip fc when Ht == H), sorted and distinct (SGLang captures in ascending order), each in
    [0, L-2] (the last layer's output is only seen final-normed)."""
    L, ids = num_layers, list(ids)
    if len(ids) < 2 or ids != sorted(set(ids)) or not all(0 <= i < L - 1 for i in ids):
        raise UserError(f"{where} {ids} must be at least two sorted, distinct layer ids in "
                        f"[0, {L - 2}] for a {L}-layer target (layer {L - 1}'s output is only "
                        f"seen final-normed)")
    return ids


def read_config(path):
    if not os.path.isdir(path):
        raise UserError(f"--draft {path}: no such directory")
    cpath = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(cpath):
        raise UserError(f"{path}: no {CONFIG_NAME}; expected a draft saved by model.py or train.py")
    d = read_json(cpath)
    from layouts import sglang_config   # speculators' layout read as SGLang's (layouts.py)
    return DraftConfig.from_json(sglang_config(d, cpath), cpath)
