"""
Session 36: is SFDD's loss explained by where a greedy draft gets accepted? For every loss row of a
held-out data set: the target's flatness (1 - cos(p, u), subset.py) and whether the draft's first
step (TTT step 0, the stored features) picks the target's argmax. Prints, per flatness quartile
(flattest first), the first step's acceptance rate and the share of all first-step acceptances.

    python results/levers-s36/flat_accept.py --data /root/eagle3/data/h41 \
        --draft /root/eagle3/runs/s33-base/checkpoints/step-000992
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from common import load_target_heads, run_main  # noqa: E402
from dataset import load_dataset_dir  # noqa: E402
from hidden import hidden_states_for  # noqa: E402
from model import Eagle3Draft  # noqa: E402
from ttt import ttt_unroll  # noqa: E402
from subset import row_flatness  # noqa: E402 (this folder's subset.py)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--n", type=int, default=None, help="first N sequences")
    a = ap.parse_args()
    manifest, seqs, _ = load_dataset_dir(a.data)
    heads, _ = load_target_heads(manifest["target"])
    lm_w = heads.get_output_embeddings().weight.float()
    draft = Eagle3Draft.from_pretrained(a.draft, embed_weight=heads.get_input_embeddings().weight)
    draft.eval()
    tid = draft.draft_ids
    flat, ok = [], []
    for k, s in enumerate(seqs[:a.n]):
        aux, fin = hidden_states_for(a.data, manifest, k)
        ids = torch.tensor(s["input_ids"])[None]
        h = next(ttt_unroll(draft, ids, aux.float()[None], 1))[0]
        pick = tid[draft.lm_head(draft.norm(h)).argmax(-1)]          # draft's token, target id
        # row t of step 0 reads feature t and token t+1 and predicts token t+2, which the
        # target predicts from its final state at t+1 (ttt.py: p_0[t] = softmax(lm_head(final_{t+1})))
        f, top = row_flatness(fin[1:], lm_w)
        m = torch.tensor(s["loss_mask"], dtype=torch.bool)[:-1]
        flat.append(f[m])
        ok.append((pick[:-1] == top)[m])
    flat, ok = torch.cat(flat), torch.cat(ok).float()
    q = torch.quantile(flat, torch.tensor([0.25, 0.5, 0.75]))
    bucket = torch.bucketize(flat, q)
    out = []
    for b in range(4):
        sel = bucket == b
        out.append({"quartile": b + 1, "rows": int(sel.sum()), "accept": ok[sel].mean().item(),
                    "share_of_accepts": (ok[sel].sum() / ok.sum()).item(),
                    "flatness_max": (q[b].item() if b < 3 else flat.max().item())})
    print(json.dumps({"rows": len(flat), "accept": ok.mean().item(), "quartiles": out}, indent=1))


if __name__ == "__main__":
    run_main(main)
