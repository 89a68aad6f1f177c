"""`python -m torch.distributed.run ... tests/nccl_shaped.py script.py args...`: run `script.py` with its world group
already created as `"cuda:gloo"`, a group with no CPU backend, as a GPU script's `init_process_group("nccl")` makes
(the script's own initialization then finds the group made, as it does after ColossalAI's `launch_from_torch`)."""
import os
import runpy
import sys

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("cuda:gloo")
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)  # where the script's own imports (examples/common.py) are found
    runpy.run_path(script, run_name="__main__")
