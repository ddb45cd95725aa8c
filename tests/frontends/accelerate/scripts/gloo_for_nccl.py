"""Run a script (`python gloo_for_nccl.py SCRIPT ARGS`) as accelerate runs it on a GPU
machine, with gloo and the CPU in place of NCCL and CUDA.

accelerate (1.15) picks its process-group backend from the devices it finds; on a machine
without one, a DeepSpeed launch (`ACCELERATE_USE_DEEPSPEED=true`, not `use_cpu`) gets no
backend, so every process believes it is alone (`num_processes == 1`, `process_index ==
0`), with DeepSpeed 0.19.8 itself as with shardwise. This mock stands in for the GPU the
tests cannot have: where accelerate would choose NCCL, it chooses gloo and the CPU.
Nothing else of accelerate is changed.
"""

import os
import runpy
import sys

from accelerate.state import PartialState
from accelerate.utils import DistributedType

_prepare_backend = PartialState._prepare_backend


def _gloo_where_nccl_would_be(self, cpu=False, sagemaker_dp=False, backend=None):
    chosen, distributed_type = _prepare_backend(self, cpu, sagemaker_dp, backend)
    if distributed_type == DistributedType.NO and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
        return "gloo", DistributedType.MULTI_CPU
    return chosen, distributed_type


PartialState._prepare_backend = _gloo_where_nccl_would_be
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
