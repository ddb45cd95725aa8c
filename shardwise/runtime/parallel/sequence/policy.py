"""Ulysses sequence parallelism as a policy: how many ranks share each sequence (their
attention exchanges positions for heads), and who splits it. Megatron's sequence
parallelism lives inside the tensor group instead (`TensorPolicy.sequence_parallel`).

`sharded_by_caller`: the script feeds each rank its shard of the positions and has
wrapped the model's attention itself (DeepSpeed's ALST: `UlyssesSPDataLoaderAdapter` and
`UlyssesSPAttentionHF`, frontends/deepspeed/api/runtime/sequence_parallel/). The model is
then left as it is (no split at the decoder, no attention rewrite); what remains of the
policy is the layout: gradients averaged over data x sequence ranks, ZeRO sharding over them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SequencePolicy:
    size: int = 1
    sharded_by_caller: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"sequence parallel size must be at least 1, got {self.size}")
        if self.sharded_by_caller and self.size == 1:
            raise ValueError("sharded_by_caller with sequence parallel size 1: there is no sequence to shard")

    @property
    def enabled(self) -> bool:
        return self.size > 1
