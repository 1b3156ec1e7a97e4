"""speculators' own `speculators train` (cli/train.py: main(TrainConfig.resolve(args))), behind
cpu_shim. Usage: spec_train.py METRICS_JSONL THREADS -- <speculators train flags>
(METRICS_JSONL "-resolve-": print the fully resolved flat config as JSON and exit)"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import cpu_shim  # noqa: E402

metrics, threads = sys.argv[1], int(sys.argv[2])
assert sys.argv[3] == "--"
torch.set_num_threads(threads)
cpu_shim.install(metrics)
from importlib.metadata import version  # noqa: E402
assert version("speculators") == "0.9.0", version("speculators")
from speculators.train.cli import main  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402

cfg = TrainConfig.resolve(sys.argv[4:])
if metrics == "-resolve-":
    import json
    print(json.dumps(cfg.flatten(), default=str))
    sys.exit(0)
main(cfg)
