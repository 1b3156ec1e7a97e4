"""Shared test fixtures: tiny randomly initialised Llama targets built in-process (no downloads)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Tiny tensors: one thread is faster than two (no OpenMP barriers), and leaves a core free.
torch.set_num_threads(1)


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
