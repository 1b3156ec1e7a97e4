"""CPU shim for speculators 0.9.0's trainer (results/peer_speculators.py says why, file:line).
Patches objects at run time; no file of speculators is changed. Does nothing on a machine with
an accelerator."""
import json
import logging
import time

import torch


def install(metrics_path=None):
    if torch.accelerator.current_accelerator() is None:
        # train/trainer.py:80,92: _StepTimer.mark/now synchronize; raises without an accelerator
        torch.accelerator.synchronize = lambda *a, **k: None
        import speculators.train.trainer as trainer
        # train/trainer.py:348,533,643: .to(self.local_rank) with local_rank 0 means cuda:0
        trainer.get_local_rank = lambda: torch.device("cpu")
        orig_init = trainer.Trainer.__init__

        def init(self, *a, **k):
            orig_init(self, *a, **k)
            # train/trainer.py:228: "cuda" when there is no accelerator (autocast device type)
            self.device_type = "cpu"
        trainer.Trainer.__init__ = init
    if metrics_path:
        import speculators.train.cli as cli
        orig_setup = cli.setup_metric_logger

        class Jsonl(logging.Handler):
            def __init__(self):
                super().__init__()
                self.f = open(metrics_path, "a")

            def emit(self, record):
                if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
                    self.f.write(json.dumps({"time": time.time(), **record.msg}, default=float) + "\n")
                    self.f.flush()

        def setup(*a, **k):
            orig_setup(*a, **k)              # dictConfig: our handler must come after it
            logging.getLogger("speculators.metrics").addHandler(Jsonl())
        cli.setup_metric_logger = setup
