"""`deepspeed.git_version_info`: what DeepSpeed records about its build, answered for this
package. `version` is the DeepSpeed release whose Python API this package follows (the
one its behaviour is checked against); no DeepSpeed C++/CUDA op is built (`installed_ops`
empty), and the ops shardwise does in Python are all usable (`compatible_ops`, from
api/ops/op_builder.py); `torch_info` describes the torch running now."""

from __future__ import annotations

import torch

from shardwise.frontends.deepspeed.alias import DEEPSPEED_API_VERSION
from shardwise.frontends.deepspeed.api.ops.op_builder import compatible_ops
from shardwise.runtime.base.torch_compat import release_info

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]

version = DEEPSPEED_API_VERSION
git_hash = "[none]"
git_branch = "[none]"
installed_ops: dict[str, bool] = {}
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _release(text: str | None) -> str:
    """"MAJOR.MINOR" of a version string, "0.0" when there is none (DeepSpeed's sentinel)."""
    if not text:
        return "0.0"
    return ".".join(text.split("+")[0].split(".")[:2])


_releases = release_info()
torch_info = {
    "version": _release(_releases["torch"]),
    "bf16_support": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    "cuda_version": _release(_releases["cuda"]),
    "nccl_version": ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0",
    "hip_version": _release(_releases["hip"]),
}
