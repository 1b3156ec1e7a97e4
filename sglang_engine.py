"""
Every call this project makes into SGLang, in one file, pinned to sglang==0.5.23.

SGLang's internals change between releases (the in-process capture below was first written for the
~0.5.9 API and crashed on 0.5.23), so the version-pinned surface lives here and nowhere else:
generate.py, bench.py and train.py import this module only on their sglang paths, and this module
imports sglang only inside the functions that need it. tests/test_sglang_contract.py checks every
SGLang module, name, keyword and attribute used here against the pinned wheel's source (no import);
tests/test_sglang_cpu.py runs it on SGLang's own code on a CPU (requirements-sglang-cpu.txt).

Three parts:
  1. server: launch_server command, /health, /generate, metrics (bench.py --backend sglang)
  2. chat regeneration through /v1/chat/completions (generate.py --backend sglang --regenerate)
  3. in-process hidden-state capture with SGLang's ModelRunner (generate.py --backend sglang
     --hidden-states, and train.py --target-backend sglang's online producer)

Which capture route, and why in-process. 0.5.23 has a public route: launch the server with
`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
--return-aux-hidden-state-layer-ids 1 14 26` (add `--disable-radix-cache`, or tokens of a cached
prefix are left out) and ask `/generate` with `return_hidden_states: true`; the aux states come back
per token in `meta_info` as JSON lists of floats. It returns the same tensors (float32, bit for
bit: tests/test_sglang_cpu.py), and it survives internal refactors. The project uses the in-process route because of size: the states are
3*Ht floats per token (Kimi-K2: 3*7168 = 21.5k values, ~200 KB of JSON text per token, so a 2k-token
sequence is ~400 MB of text to print, send and parse) against a tensor handed over in memory, and
because the producer needs the final-normed state too (for the target's logits), which the public
route does not return alongside the aux states. The price is this file's dependence on internals,
which the contract test pins.

Accept length. SGLang's `meta_info.spec_verify_ct` counts verify rounds of finished requests, and
`completion_tokens / spec_verify_ct` (SpecForge's definition) counts the first token, made by the
prefill and not by any verify round, in the numerator: for short answers it reads higher than
committed-per-round. bench.py and speculate.py report exactly this quantity, pooled over prompts
(sum of tokens / sum of rounds), with the per-prompt mean beside it under its own name.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from common import UserError

SGLANG_VERSION = "0.5.23"


def check_layer_ids(layer_ids, num_layers):
    """Aux layer ids must be sorted and distinct: SGLang captures the layers in ascending order
    whatever order it is given (it tests `i in layers_to_capture` while walking the layers), while
    the transformers path concatenates them in the given order; unsorted ids would train a draft on
    features SGLang then feeds in another order. The last layer cannot be captured (SGLang records
    the input of layer i+1)."""
    ids = [int(i) for i in layer_ids]
    if ids != sorted(set(ids)):
        raise UserError(f"aux layer ids {ids} must be sorted ascending and distinct (SGLang "
                        f"captures layers in ascending order)")
    if ids and (ids[0] < 0 or ids[-1] > num_layers - 2):
        raise UserError(f"aux layer ids {ids} must lie in 0..{num_layers - 2} (the target has "
                        f"{num_layers} layers; the last one's output cannot be captured)")
    return ids


def require_sglang(need_gpu=True):
    """Import check with a one-line error. On a CPU, SGLang's CPU engine runs only with
    SGLANG_USE_CPU_ENGINE=1 (the tests' route); otherwise a GPU is needed."""
    try:
        import sglang  # noqa: F401
    except ImportError:
        raise UserError("--backend sglang needs sglang: pip install -r requirements-sglang.txt "
                        "(GPU) or requirements-sglang-cpu.txt (CPU tests)")
    import torch
    if need_gpu and not torch.cuda.is_available() and not cpu_engine():
        raise UserError("--backend sglang needs a CUDA GPU (or SGLANG_USE_CPU_ENGINE=1 for "
                        "SGLang's CPU engine)")


def cpu_engine():
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() in ("1", "true")


def sglang_device():
    return "cpu" if cpu_engine() else "cuda"


# ----------------------------------------------------------------------------------------------
# 1. Server: python -m sglang.launch_server, /health, /generate

# EAGLE on SGLang's CPU engine without AMX (README, SGLang section). Without AMX SGLang rewrites
# the base attention backend to torch_native (srt/arg_groups/overrides.py:1301-1310), which has no
# EAGLE draft backend (speculative/draft_utils.py:63-64) and ignores the tree mask; the split
# prefill/decode flags survive that rewrite and route target prefill/verify and every draft
# forward to IntelAMXAttnBackend, which calls sgl_kernel's CPU attention and spec kernels (on
# this project's CPUs: the test-only stand-ins in tests/sglang_cpu_spec_shims/). topk > 1 needs
# page size 1 (srt/arg_groups/speculative_hook.py:1273-1285).
CPU_SPEC_SERVER_ARGS = ["--page-size", "1", "--disable-radix-cache",
                        "--prefill-attention-backend", "intel_amx",
                        "--decode-attention-backend", "intel_amx"]
# TORCHDYNAMO_DISABLE: spec_utils.py:437 torch.compiles _select_top_k_tokens_later (reached even
# with topk 1 on CPU). SGLANG_NATIVE_MOVE_KV_CACHE: topk > 1 moves accepted KV rows with the
# pure-torch move_kv_cache_native (srt/environ.py:598).
CPU_SPEC_ENV = {"TORCHDYNAMO_DISABLE": "1", "SGLANG_NATIVE_MOVE_KV_CACHE": "1"}


def server_command(target_dir, draft, cfg, host, port, dtype, extra=(), cpu=None):
    """The launch_server command line for one bench config (batch, steps, topk, draft tokens).
    No speculative flags for the baseline. --dtype is always passed: without it a float32
    checkpoint is served as float16. With topk 1 SGLang forces draft tokens to steps + 1.
    SGLang's CPU engine takes `--device cpu` through `extra` (bench.py --server-args); on it
    (`cpu`, default: SGLANG_USE_CPU_ENGINE is set) a speculative config adds CPU_SPEC_SERVER_ARGS."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", target_dir,
           "--host", host, "--port", str(port), "--dtype", dtype]
    if cfg.speculative:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
                "--speculative-num-steps", str(cfg.steps),
                "--speculative-eagle-topk", str(cfg.topk),
                "--speculative-num-draft-tokens", str(cfg.num_draft_tokens)]
        if cpu_engine() if cpu is None else cpu:
            cmd += CPU_SPEC_SERVER_ARGS
    return cmd + list(extra)


def server_env(cfg, env=None, cpu=None):
    """The environment for a launched server: `env` (default: this process's), plus CPU_SPEC_ENV
    for a speculative config on the CPU engine."""
    env = dict(os.environ if env is None else env)
    if cfg.speculative and (cpu_engine() if cpu is None else cpu):
        env.update(CPU_SPEC_ENV)
    return env


def http_json(url, payload=None, timeout=600):
    """GET (payload None) or POST JSON with urllib; returns the decoded body."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        raise UserError(f"{url}: HTTP {e.code} {e.read()[:200]!r}")
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"{url}: {getattr(e, 'reason', e)}")
    try:
        return json.loads(body) if body.strip() else None
    except json.JSONDecodeError:
        raise UserError(f"{url}: the reply is not JSON ({body[:100]!r})")


def healthy(base_url):
    """/health is 503 while the server starts and 200 once a one-token round trip worked."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(base_url, proc, timeout, log_path):
    """Poll /health until it answers 200; fail early if the server process dies."""
    t0 = time.time()
    while not healthy(base_url):
        if proc is not None and proc.poll() is not None:
            raise UserError(f"the sglang server exited with code {proc.returncode} before it was "
                            f"ready; its log: {log_path}")
        if time.time() - t0 > timeout:
            raise UserError(f"the sglang server at {base_url} was not healthy after {timeout:.0f} "
                            f"s; its log: {log_path}")
        time.sleep(0.5)


def stop_process(proc, grace=20):
    """Terminate a launched server and everything it started (its own process group): SIGTERM,
    then SIGKILL after `grace` seconds. SGLang forks scheduler and detokenizer processes, so
    killing only the leader could leave a GPU held."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:   # stragglers in the group (or the leader, if it ignored SIGTERM)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@contextlib.contextmanager
def launched_server(cmd, base_url, timeout, log_path, env=None):
    """Start `cmd` in its own session, wait until healthy, yield the process, always kill it."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        try:
            wait_healthy(base_url, proc, timeout, log_path)
            yield proc
        finally:
            stop_process(proc)


def generate(base_url, ids, sampling, timeout=3600):
    """One request to the native /generate endpoint; returns (text, meta_info)."""
    reply = http_json(base_url + "/generate", {"input_ids": ids, "sampling_params": sampling},
                      timeout)
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
        raise UserError(f"{base_url}/generate: unexpected reply (no meta_info)")
    return reply.get("text", ""), reply["meta_info"]


def metrics(metas, wall):
    """SpecForge's definitions: accept length = sum(completion_tokens) / sum(spec_verify_ct),
    pooled (counts the prefill token, see the top of this file; a server without speculation
    reports no spec_verify_ct: 1.0), beside it the mean of the per-request ratios (SGLang's own
    meta_info.spec_accept_length), throughput = tokens / wall."""
    tokens = sum(int(m.get("completion_tokens", 0)) for m in metas)
    verify = sum(int(m.get("spec_verify_ct", 0)) for m in metas)
    each = [int(m["completion_tokens"]) / int(m["spec_verify_ct"]) for m in metas
            if m.get("spec_verify_ct")]
    return {"new_tokens": tokens, "rounds": verify or None,
            "accept_length": tokens / verify if verify else 1.0,
            "per_prompt_mean_accept_length": sum(each) / len(each) if each else 1.0,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0, "wall_time": wall}


# ----------------------------------------------------------------------------------------------
# 2. Chat regeneration through /v1/chat/completions

# The chat endpoint fills top_k, min_p and repetition_penalty from the model's
# generation_config.json unless the request sets them (`--sampling-defaults model`, the default;
# srt/entrypoints/openai/serving_chat.py). A "greedy" regeneration with the model's repetition
# penalty is not the target's greedy distribution, so these neutral values are always sent.
NEUTRAL_SAMPLING = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def chat_completion(url, model_name, messages, max_tokens, temperature, top_p, timeout=600):
    """One call to an OpenAI-compatible /v1/chat/completions (SGLang's server). Returns the
    assistant message dict. Plain urllib: no client library needed."""
    body = {"model": model_name, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, **NEUTRAL_SAMPLING}
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            reply = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise UserError(f"--server-url {url}: HTTP {e.code} ({e.read()[:200]!r})")
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"--server-url {url}: cannot reach the server ({e})")
    try:
        choice = reply["choices"][0]
        msg = {"role": "assistant", "content": choice["message"]["content"] or ""}
    except (KeyError, IndexError, TypeError):
        raise UserError(f"--server-url {url}: not an OpenAI chat completion reply: {str(reply)[:200]}")
    if choice.get("finish_reason") == "length":
        msg["truncated"] = True
    return msg


def fill_http(url, model_name, skeletons, max_new_tokens, temperature, top_p, concurrency):
    """Fill the holes (None turns) of conversations through the server, one thread per
    conversation (turns of one conversation are sequential: each sees the earlier answers),
    `concurrency` conversations in flight."""
    from concurrent.futures import ThreadPoolExecutor

    def one(sk):
        conv = list(sk)
        for j, m in enumerate(conv):
            if m is None:
                strip = [{"role": x["role"], "content": x["content"]} for x in conv[:j]]
                conv[j] = chat_completion(url, model_name, strip, max_new_tokens, temperature, top_p)
        return conv

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, skeletons))


# ----------------------------------------------------------------------------------------------
# 3. In-process hidden-state capture (SGLang's ModelRunner, no server)
#
# The template is SGLang's own single-process harness, sglang/benchmark/one_batch.py (main,
# correctness_test, load_model, extend). What changed since the ~0.5.9 API (all 0.5.23):
#   - ModelRunner(model_config, mem_fraction_static, gpu_id, nccl_port, server_args): no tp/pp/ep
#     ranks (srt/model_executor/model_runner.py); it asserts that the process published its
#     config first (srt/runtime_context.py: publish / assert_published, role "scheduler").
#   - pools and attention backends are built by explicit calls (alloc_memory_pool,
#     init_attention_backends, init_cuda_graphs), not by the constructor.
#   - Req carries full_untruncated_fill_ids / extend_end / logprob_start_len (not fill_ids), and
#     prepare_for_extend leaves the ids in prefill_input_ids_cpu with batch.input_ids None.
#   - ForwardBatch.init_new(batch, runner, *, capture_hidden_mode, return_hidden_states_before_norm)
#     takes the ScheduleBatch itself (get_model_worker_batch is gone).

def runner(model_path, dtype="bfloat16", mem_fraction_static=0.8, max_total_tokens=None,
           gpu_id=0, trust_remote_code=False):
    """An in-process SGLang ModelRunner on one device (tp 1), set up as one_batch.py does.
    One per process: it publishes process-wide config and starts a (1-rank) process group.
    `max_total_tokens` caps the KV pool (the online producer shares the GPU with the trainer)."""
    require_sglang()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    device = sglang_device()
    kw = dict(model_path=model_path, dtype=dtype, device=device, tp_size=1,
              mem_fraction_static=mem_fraction_static, disable_cuda_graph=True,
              skip_tokenizer_init=True, disable_radix_cache=True,
              trust_remote_code=trust_remote_code)
    if max_total_tokens:
        kw["max_total_tokens"] = max_total_tokens
    server_args = ServerArgs(**kw)
    server_args.resolve_once()          # the launcher's step: fills every derived setting
    _set_envs_and_config(server_args)   # env vars and process settings the engine sets
    port_args = PortArgs.init_new(server_args)
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0),
                             gpu_id=gpu_id))
    initialize_moe_config()             # process-global configs one_batch.py sets before loading
    initialize_fp8_gemm_config()
    initialize_bf16_gemm_config()
    initialize_fp4_gemm_config()
    model_config = ModelConfig.from_server_args(server_args)
    bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device,
                                    dist_port=port_args.nccl_port)
    bootstrap.init_layer_runtime(model_config=model_config)
    r = ModelRunner(model_config=model_config, mem_fraction_static=mem_fraction_static,
                    gpu_id=gpu_id, nccl_port=port_args.nccl_port, server_args=server_args)
    r.alloc_memory_pool()
    r.init_attention_backends()
    r.init_cuda_graphs()                # a no-op with disable_cuda_graph; kept as one_batch.py has it
    return r


class _NoPrefixCache:
    """The tree cache ScheduleBatch wants, for a batch that shares nothing: allocation only, no
    prefix matching (one_batch.py's TreeCacheNamespace). Nothing is cached between batches."""

    def __init__(self, page_size, device, allocator):
        self.page_size, self.device, self.token_to_kv_pool_allocator = page_size, device, allocator

    def supports_swa(self):
        return False

    def supports_mamba(self):
        return False

    def supports_prefix_sharing(self):
        return True

    def evict(self, params):
        pass

    def maybe_hand_to_session(self, req):
        pass


def hidden_states(r, sequences, layer_ids, batch_size=8):
    """The SGLang backend of hidden.target_hidden_states: same inputs, same outputs, a list of
    (aux [T, 3*Ht], final [T, Ht]) per sequence. `r` is from runner().

    set_eagle3_layers_to_capture(ids) makes the target record the INPUT of layers i+1 (it adds 1),
    which is the output of layer i: transformers' hidden_states[i + 1]. With CaptureHiddenMode.FULL
    the logits processor returns them concatenated for every token of the batch, requests in
    order: [sum T, 3*Ht]. The final-normed state (transformers' hidden_states[-1]) is taken with a
    forward hook on the model's final norm (called as norm(x, residual) -> (out, residual))."""
    import torch
    from array import array
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    layer_ids = check_layer_ids(layer_ids, r.model_config.num_hidden_layers)
    model = r.model
    model.set_eagle3_layers_to_capture(list(layer_ids))
    captured = {}

    def grab_final(module, inputs, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    hook = model.model.norm.register_forward_hook(grab_final)
    out = [None] * len(sequences)
    params = SamplingParams(temperature=0, max_new_tokens=1)
    try:
        for s in range(0, len(sequences), batch_size):
            chunk = list(range(s, min(s + batch_size, len(sequences))))
            reqs = []
            for k in chunk:
                req = Req(rid=str(k), origin_input_text="",
                          origin_input_ids=array("q", sequences[k]), sampling_params=params)
                req.full_untruncated_fill_ids = req.origin_input_ids
                req.extend_end = len(req.origin_input_ids)
                req.logprob_start_len = -1
                reqs.append(req)
            batch = ScheduleBatch.init_new(
                reqs=reqs, req_to_token_pool=r.req_to_token_pool,
                token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
                tree_cache=_NoPrefixCache(r.page_size, r.device, r.token_to_kv_pool_allocator),
                model_config=r.model_config, enable_overlap=False,
                spec_algorithm=SpeculativeAlgorithm.NONE)
            batch.prepare_for_extend()
            if batch.input_ids is None:  # 0.5.23 leaves the ids on the host; move them as one_batch.py
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device)
                batch.prefill_input_ids_cpu = None
            fb = ForwardBatch.init_new(batch, r, capture_hidden_mode=CaptureHiddenMode.FULL,
                                       return_hidden_states_before_norm=False)
            with torch.no_grad():
                logits_output = r.forward(fb).logits_output
            aux_all = logits_output.hidden_states
            lens = [len(sequences[k]) for k in chunk]
            for k, aux, fin in zip(chunk, aux_all.split(lens), captured["final"].split(lens)):
                out[k] = (aux.cpu().clone(), fin.cpu().clone())
            r.req_to_token_pool.clear()   # nothing is kept between batches
            r.token_to_kv_pool_allocator.clear()
    finally:
        hook.remove()
    return out
