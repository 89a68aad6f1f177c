# Copied from ColossalAI (tests/test_booster/test_accelerator.py at commit 4f9953be335ef371b3848719ddafe596c01ecd37),
# Copyright the ColossalAI authors, licensed under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0). Changed only by the port rule
#     sed -i -E 's/\bcolossalai\b/booster_plugin.colossalai/g'
# and the CPU-only rule of benchmarks/port_colossalai_tests.py (.cuda() -> .cpu(), "cuda" -> "cpu"), so that
# the suite runs on CPU machines.
import torch.nn as nn

from booster_plugin.colossalai.booster.accelerator import Accelerator
from booster_plugin.colossalai.testing import clear_cache_before_run, parameterize


@clear_cache_before_run()
@parameterize("device", ["cpu", "cpu"])
def test_accelerator(device):
    accelerator = Accelerator(device)
    model = nn.Linear(8, 8)
    model = accelerator.configure_model(model)
    assert next(model.parameters()).device.type == device
    del model, accelerator
