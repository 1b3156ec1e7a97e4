"""What bench.py reports and how: the identity of what was measured (weights' sha256, the machine,
package versions), the table, the comparison with an earlier run (paired prompt by prompt, with a
bootstrap interval), the plot and the atomic write of the results file."""
import hashlib
import json
import os
import platform
import tempfile

from common import UserError

BASELINE = "1,0,0,0"
PEER_GENERATE = "hf-generate"
PEER_LOOKUP = "hf-prompt-lookup"


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_identity(path):
    """Where a model came from and which weights: sha256 of its model.safetensors (None for a hub
    id or a sharded checkpoint)."""
    if path is None:
        return None
    w = os.path.join(path, "model.safetensors")
    return {"path": os.path.abspath(path) if os.path.isdir(path) else path,
            "sha256": sha256_file(w) if os.path.isfile(w) else None}


def machine_info(device):
    """What a figure was measured on: the CPU model and the flags that decide its speed (bf16 is
    fast only with avx512_bf16 / amx_bf16: README, *Which dtype*), cores and threads."""
    import torch
    from common import SPEED_FLAGS, cpu_flags, cpu_name, machine_summary
    flags = cpu_flags()
    info = {"summary": machine_summary(flags), "cpu": cpu_name(),
            "cpu_flags": {f: f in flags for f in SPEED_FLAGS},
            "platform": platform.platform(), "processor": platform.processor() or None,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(device)}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions(backend):
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": platform.python_version()}
    for pkg in ["torch", "transformers"] + (["sglang"] if backend == "sglang" else []):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def format_table(entries):
    cols = ["benchmark", "config", "accept len", "mean/prompt", "per-position acceptance",
            "tok/s", "wall s", "speedup", "mismatches"]
    rows = []
    for e in entries:
        pa = e["position_acceptance"]
        rows.append([e["benchmark"], e["config"], f"{e['accept_length']:.2f}",
                     f"{e['per_prompt_mean_accept_length']:.2f}",
                     " ".join(f"{a:.2f}" for a in pa) if pa else "-",
                     f"{e['tokens_per_s']:.1f}", f"{e['wall_time']:.1f}",
                     f"{e['speedup']:.2f}x" if e["speedup"] is not None else "-",
                     "-" if e["mismatches"] is None else str(e["mismatches"])])
    width = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, width)).rstrip()
    table = [line(cols), line(["-" * w for w in width])] + [line(r) for r in rows]
    cats = [e for e in entries
            if e.get("by_category") and e["config"] not in (BASELINE, PEER_GENERATE)]
    if cats:   # MT-Bench: accept length by question category, one row per runner that drafts
        names = list(cats[0]["by_category"])
        sub = [["benchmark", "config"] + names] + [
            [e["benchmark"], e["config"]] + [f"{e['by_category'][n]['accept_length']:.2f}"
                                             if n in e["by_category"] else "-" for n in names]
            for e in cats]
        w2 = [max(len(x) for x in col) for col in zip(*sub)]
        table += ["", "accept length by category"]
        table += ["  ".join(x.ljust(w) for x, w in zip(r, w2)).rstrip() for r in sub]
    return "\n".join(table)


def read_results(path):
    """The payload of an earlier bench.py run (--compare)."""
    try:
        with open(path) as f:
            payload = json.load(f)
        payload["results"][0]["accept_length"]
        return payload
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise UserError(f"--compare {path}: not a bench.py results file ({e})")


def paired_difference(ours, theirs, resamples=2000, seed=0):
    """Two runs on the same prompts (another draft, say), prompt by prompt: how many prompts
    this run's accept length is ahead of, tied with and behind the earlier run's, and the
    bootstrap 95% interval of the pooled difference (prompts resampled with replacement; the
    pooled figure weights each prompt by its rounds, so a ratio of sums is resampled, not a mean
    of ratios). None unless both runs recorded the same prompts."""
    import random
    key = lambda p: (p["item"], p["turn"], p["repeat"])
    a = {key(p): p for p in ours.get("per_prompt") or []}
    b = {key(p): p for p in theirs.get("per_prompt") or []}
    if not a or a.keys() != b.keys():
        return None
    rows = [(a[k]["new_tokens"], a[k]["rounds"], b[k]["new_tokens"], b[k]["rounds"]) for k in a]
    each = [t1 / max(r1, 1) - t2 / max(r2, 1) for t1, r1, t2, r2 in rows]

    def pooled(rs):
        return (sum(r[0] for r in rs) / max(sum(r[1] for r in rs), 1)
                - sum(r[2] for r in rs) / max(sum(r[3] for r in rs), 1))
    rng = random.Random(seed)
    boot = sorted(pooled([rows[rng.randrange(len(rows))] for _ in rows]) for _ in range(resamples))
    return {"ahead": sum(d > 1e-12 for d in each), "tied": sum(abs(d) <= 1e-12 for d in each),
            "behind": sum(d < -1e-12 for d in each), "difference": pooled(rows),
            "low": boot[int(0.025 * resamples)], "high": boot[int(0.975 * resamples) - 1]}


def format_comparison(entries, other, path):
    """Accept length of this run beside an earlier run's, for the configs both ran; prompt by
    prompt where both recorded the same prompts (paired_difference)."""
    by = {(e["benchmark"], e["config"]): e for e in other["results"]}
    theirs = other["results"][0]["settings"].get("backend", "earlier")
    ours = entries[0]["settings"]["backend"] if entries else "this run"
    if ours == theirs:   # two drafts (or two modes) on one backend: name the runs, not the backend
        ours, theirs = "this run", "compared"
    rows = [["benchmark", "config", f"{ours} accept len", f"{theirs} accept len", "rounds",
             "new tokens", "prompts ahead/tied/behind, 95% interval of the difference"]]
    for e in entries:
        o = by.get((e["benchmark"], e["config"]))
        if o is None or e["config"] in (BASELINE, PEER_GENERATE, PEER_LOOKUP):
            continue
        d = paired_difference(e, o)
        rows.append([e["benchmark"], e["config"], f"{e['accept_length']:.3f}",
                     f"{o['accept_length']:.3f}", f"{e['rounds']} / {o['rounds']}",
                     f"{e['new_tokens']} / {o['new_tokens']}",
                     "-" if d is None else f"{d['ahead']}/{d['tied']}/{d['behind']}, "
                     f"{d['low']:+.3f} .. {d['high']:+.3f}"])
    width = [max(len(x) for x in col) for col in zip(*rows)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, width)).rstrip() for r in rows]
    keys = ("max_new_tokens", "temperature", "top_p", "dtype")
    differ = [k for k in keys if other["results"][0]["settings"].get(k)
              != entries[0]["settings"].get(k)] if entries else []
    note = f" (settings differ: {', '.join(differ)})" if differ else ""
    return "\n".join(["", f"accept length beside {path}{note}"] + lines)


def plot(entries, path):
    """Grouped bars: accept length (left) and speedup (right), one group per benchmark."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    benches = list(dict.fromkeys(e["benchmark"] for e in entries))
    configs = list(dict.fromkeys(e["config"] for e in entries))
    by = {(e["benchmark"], e["config"]): e for e in entries}
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2 + 1.2 * len(benches) * len(configs)), 4))
    w = 0.8 / len(configs)
    for ax, key, title in [(axes[0], "accept_length", "accept length (tokens / verify)"),
                           (axes[1], "speedup", "speedup over 1,0,0,0")]:
        for j, c in enumerate(configs):
            ys = [by[(b, c)][key] if (b, c) in by and by[(b, c)][key] is not None else 0
                  for b in benches]
            ax.bar([i + (j - (len(configs) - 1) / 2) * w for i in range(len(benches))], ys, w,
                   label=c)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(benches)), benches)
        ax.set_title(title)
    # one legend for both panels, below them, so it never hides a bar
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(configs), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def write_outputs(payload, json_path, png_path):
    """Both files are written under temporary names and renamed only when both are complete: an
    error or Ctrl-C never leaves a partial results file."""
    tmps = []
    try:
        for path in [json_path] + ([png_path] if png_path else []):
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=d)
            os.close(fd)
            tmps.append((tmp, path))
        with open(tmps[0][0], "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
        if png_path:
            plot(payload["results"], tmps[1][0])
        for tmp, path in reversed(tmps):   # the JSON last: no results file without its plot
            os.replace(tmp, path)
    finally:
        for tmp, _ in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
