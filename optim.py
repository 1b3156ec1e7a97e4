"""
The optimizers of train.py: AdamW, or Muon on the draft's hidden matrices beside AdamW on the rest,
and the learning-rate schedule they share.

    opts, scheds = make_optimizers(named_params, args, warmup, total, device)

Muon (torch.optim.Muon, as speculators' trainer uses it) replaces each 2D weight's momentum M by
about U V^T where M = U S V^T (a Newton-Schulz iteration), so one step moves every direction of the
matrix at the same rate instead of mostly the top few singular directions. The lever ablations
(README, *Lever ablations*) measured it at lr 3e-3 with steps of 2 sequences as the best recipe.
"""
import math
import sys

import torch

from common import UserError


def make_optimizers(named, args, warmup, total, device, verbose=True):
    """(optimizers, schedulers) for (name, param) pairs. --optimizer muon: Muon orthogonalises
    each 2D hidden weight's momentum, so every direction of the matrix moves at one rate; lm_head
    and the norms stay on AdamW (Muon is for hidden matrices only). match_rms_adamw scales its
    update to AdamW's RMS, so one --lr can serve both; --muon-lr gives Muon its own (Muon's best
    lr need not be the head's). The optimizers step together, one schedule each."""
    muon, rest = muon_split(named) if args.optimizer == "muon" else ([], [p for _, p in named])
    opts = [torch.optim.AdamW(rest, lr=args.lr, betas=(0.9, 0.95),
                              weight_decay=args.weight_decay)] if rest else []
    if muon:
        if muon_in_fp32_here(device) and verbose:
            print("Muon's Newton-Schulz in fp32 (bf16 is not native here)", file=sys.stderr)
        opts.append(torch.optim.Muon(muon, lr=args.muon_lr or args.lr, momentum=0.95,
                                     weight_decay=args.weight_decay,
                                     adjust_lr_fn="match_rms_adamw"))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(warmup, total, args.min_lr_ratio))
              for o in opts]
    return opts, scheds


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz iteration (torch/optim/_muon.py, the same quintic
    X <- aX + (bA + cA^2)X with A = XX^T, from X = G/|G|_F) in fp32 instead of bf16. It maps G =
    U S V^T to about U V^T: every singular value near one, so the step moves all directions of
    the matrix alike. Measured on an AVX2 EPYC, one thread, the 8 matrices of SmolLM2's draft:
    24 s per step in bf16 (no native bf16: each matmul converts around an fp32 kernel), 1.5 s
    in fp32, against a 6 s draft step."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def muon_split(named):
    """(Muon's params, AdamW's) from (name, param) pairs: Muon takes the 2D hidden matrices."""
    muon = [p for n, p in named if p.ndim == 2 and min(p.shape) > 1 and "lm_head" not in n]
    return muon, [p for _, p in named if all(p is not m for m in muon)]


def muon_in_fp32_here(device, flags=None):
    """Where bf16 is not native (common.native_bf16; flags injectable for tests), point
    torch.optim.Muon at newton_schulz_fp32 (it looks the function up in its module at each
    step); elsewhere leave torch's bf16 one. Returns whether it did."""
    import torch.optim._muon as muon
    from common import native_bf16
    slow = not native_bf16(device, flags)[0]
    if slow and not hasattr(muon, "_zeropower_via_newtonschulz"):
        raise UserError(f"--optimizer muon: torch {torch.__version__} has no "
                        f"torch.optim._muon._zeropower_via_newtonschulz to run in fp32")
    if slow:
        muon._zeropower_via_newtonschulz = newton_schulz_fp32
    return slow


def lr_lambda(warmup, total, min_ratio):
    """Linear warmup, then cosine from 1 to min_ratio at the last step."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f
