"""Test-only stand-in for the CUDA-only `sglang-kernel` wheel WITH the CPU ops SGLang 0.5.23's
EAGLE3 worker calls (../README.md). It takes the names-only stand-in's place
(tests/sglang_cpu_shims/sgl_kernel) when this folder comes first on PYTHONPATH.

The eleven ops are pure torch (ops.py). The two attention kernels are called as
`torch.ops.sgl_kernel.*` (layers/attention/intel_amx_backend.py), so they are registered with the
dispatcher as the real wheel does; the rest are imported by name (`from sgl_kernel import X_cpu`).
Every other `*_cpu` name still imports and raises when called, as in the names-only stand-in, and
`convert_weight_packed` is deliberately absent: with it SGLang would switch on AMX weight packing
(srt/utils/common.py `_is_intel_amx_backend_available`)."""
import torch

from . import ops

_lib = torch.library.Library("sgl_kernel", "DEF")
_lib.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend,"
    " Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token,"
    " Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc,"
    " int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn,"
    " int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask,"
    " bool is_causal) -> ()")
_lib.define(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale,"
    " float v_scale, Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc,"
    " Tensor(d!) attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens,"
    " float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size,"
    " Tensor? encoder_lens, Tensor? sinks) -> ()")
_lib.impl("extend_attention_cpu", ops.extend_attention, "CPU")
_lib.impl("decode_attention_cpu", ops.decode_attention, "CPU")

assign_req_to_token_pool_cpu = ops.assign_req_to_token_pool
assign_extend_cache_locs_cpu = ops.assign_extend_cache_locs
assign_draft_cache_locs_contiguous_cpu = ops.assign_draft_cache_locs_contiguous
build_draft_decode_metadata_cpu = ops.build_draft_decode_metadata
build_tree_kernel_efficient_cpu = ops.build_tree_kernel_efficient
verify_tree_greedy_cpu = ops.verify_tree_greedy
fill_bonus_tokens_cpu = ops.fill_bonus_tokens
fill_accept_out_cache_loc_cpu = ops.fill_accept_out_cache_loc
copy_all_layer_kv_cache_cpu = ops.copy_all_layer_kv_cache


def _missing(name):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} was called: it is a CPU kernel this test stand-in "
                           f"does not have (tests/sglang_cpu_spec_shims/README.md)")
    kernel.__name__ = name
    return kernel


def __getattr__(name):
    if name.endswith("_cpu"):
        return _missing(name)
    raise AttributeError(f"module 'sgl_kernel' (test stand-in) has no attribute {name!r}")
