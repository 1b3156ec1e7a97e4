"""rows.jsonl (input_ids, loss_mask, seq_len) -> the Arrow data set speculators' ArrowDataset
reads (as cli/prepare_data.py writes it: set_format("torch") then save_to_disk)."""
import json
import sys

import torch
from datasets import Dataset, load_from_disk

src, out = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(src)]
cols = {k: [r[k] for r in rows] for k in ("input_ids", "loss_mask", "seq_len")}
ds = Dataset.from_dict(cols)
ds.set_format(type="torch")
ds.save_to_disk(out)
back = load_from_disk(out)
assert len(back) == len(rows)
for i in (0, len(rows) - 1):
    assert isinstance(back[i]["input_ids"], torch.Tensor), type(back[i]["input_ids"])
    assert back[i]["input_ids"].tolist() == rows[i]["input_ids"]
    assert back[i]["loss_mask"].tolist() == rows[i]["loss_mask"]
print(json.dumps({"rows": len(back), "columns": back.column_names}))
