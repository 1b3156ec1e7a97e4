"""Shared test fixtures: tiny randomly initialised Llama targets built in-process (no downloads)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Tiny tensors: one thread is faster than two (no OpenMP barriers), and leaves a core free.
torch.set_num_threads(1)
# Under pytest-xdist (`-n 2`, the README's command) the workers share the cores: the scripts a
# worker runs (train.py, speculate.py, ... through tests/runscript.py) take one thread each too,
# unless the caller set a number.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_tiny_target(vocab_size=64, hidden_size=32, layers=8, heads=4, kv_heads=2, seed=0,
                     eos_token_id=None, max_positions=512, rope_theta=10000.0):
    """A random Llama causal LM small enough that a forward takes about a millisecond."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
                      bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).float().eval().requires_grad_(False)
    return model


@pytest.fixture
def tiny_target():
    return make_tiny_target()


@pytest.fixture(scope="session")
def lookup():
    """(target, draft): the third-order lookup target and its hand-built draft
    (tests/lookup_fixture.py). Shared by the session: tests must not modify them."""
    from lookup_fixture import lookup_pair
    return lookup_pair()


# A Kimi-K2-like target: DeepSeek-V3 architecture (MLA attention, MoE with a shared expert, YaRN
# RoPE) whose config, model and tokenizer classes are remote code shipped in the directory (as
# moonshotai/Kimi-K2-Instruct's are), with a slow Python tokenizer (no offsets) and a thinking chat
# template that drops earlier turns' reasoning (Kimi-K2.5 / Qwen3 style). Loading it needs
# trust_remote_code=True.
KIMI_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "kimi_remote")
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set c = m['content'] -%}{%- set r = '' -%}"
    "{%- if '</think>' in c -%}{%- set r = c.split('</think>')[0].replace('<think>', '') -%}"
    "{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>' + r + '</think>' -}}{%- endif -%}"
    "{{- c + '<|im_end|>' -}}"
    "{%- else -%}"
    "{{- '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + m['content'] + '<|im_end|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}")


def kimi_tokenizer(chat_template=THINKING_TEMPLATE):
    """The fixture's slow tokenizer, imported directly (no remote-code machinery)."""
    sys.path.insert(0, KIMI_FIXTURE)
    try:
        from tokenization_kimi_tiny import KimiTinyTokenizer
    finally:
        sys.path.remove(KIMI_FIXTURE)
    tok = KimiTinyTokenizer()
    tok.chat_template = chat_template
    return tok


def save_tiny_kimi_target(path, layers=6, hidden_size=32, seed=0):
    """Write the tiny Kimi-like target directory described above; returns its path."""
    import json
    import shutil
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    path = str(path)
    tok = kimi_tokenizer()
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=None)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():   # sharper logits: greedy ties far above fp32 noise
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    # save_pretrained writes the MoE experts one by one (DeepSeek-V3's checkpoint layout) and the
    # native class fuses them on load; the remote class here is keyed "kimi_k2", which has no such
    # conversion, so store the weights under the model's own (fused) names
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(path)
    for f in ("configuration_kimi_tiny.py", "modeling_kimi_tiny.py", "tokenization_kimi_tiny.py"):
        shutil.copy(os.path.join(KIMI_FIXTURE, f), path)
    cpath = os.path.join(path, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    c.update(model_type="kimi_k2", architectures=["KimiTinyForCausalLM"], auto_map={
        "AutoConfig": "configuration_kimi_tiny.KimiTinyConfig",
        "AutoModelForCausalLM": "modeling_kimi_tiny.KimiTinyForCausalLM"})
    with open(cpath, "w") as f:
        json.dump(c, f, indent=1)
    tpath = os.path.join(path, "tokenizer_config.json")
    with open(tpath) as f:
        t = json.load(f)
    t.update(tokenizer_class="KimiTinyTokenizer",
             auto_map={"AutoTokenizer": ["tokenization_kimi_tiny.KimiTinyTokenizer", None]})
    with open(tpath, "w") as f:
        json.dump(t, f, indent=1)
    return path
