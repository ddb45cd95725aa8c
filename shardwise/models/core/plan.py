"""What shardwise needs to know about a model to parallelize it: a `ModelPlan`.

Each supported family writes one (shardwise GPT: models/gpt/parallelize.py; Hugging Face
Llama / Mistral / Qwen2 / Qwen3: models/llama.py; GPT-2: models/gpt2.py), and a user's own
model gets the same by writing one and passing it to `parallelize` (or to
`shardwise.build_engine(..., plan=...)`). Every field is optional: a plan needs only what
the policies in use ask for.

    plan = ModelPlan(
        name="MyDecoder",
        layers="decoder.layers",                       # recomputation, sequence parallelism, pipeline
        final_norm="decoder.norm",
        tensor_styles={"decoder.layers.*.attn.q": "colwise", "decoder.layers.*.attn.out": "rowwise",
                       "decoder.layers.*.mlp.up": "colwise", "decoder.layers.*.mlp.down": "rowwise",
                       "embed": "vocab_embedding", "head": "vocab_head"},
        divisible={"attention heads": 16, "vocabulary": 32000},
        heads=16, kv_heads=16,
    )

Styles are documented in runtime/parallel/tensor/styles.py; a module only your model has
takes a `Style` function in place of a name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from torch import nn

from shardwise.runtime.parallel.tensor.plans import TensorPlan

if TYPE_CHECKING:  # what the fields hold; importing them would import the runtime's parallelisms
    from shardwise.runtime.data.random_ltd import KeptInputs
    from shardwise.runtime.distributed.collectives import Communicator
    from shardwise.runtime.ops.policy import LayoutFactory
    from shardwise.runtime.parallel.pipeline.adapter import Adapter
    from shardwise.runtime.parallel.tensor.styles import Style

# how a family's attention exchanges sequence chunks for heads (Ulysses), given its layers
UlyssesAttention = Callable[[nn.ModuleList, "Communicator"], None]


@dataclass(frozen=True)
class ModelPlan:
    name: str = "model"  # for messages
    layers: str | None = None  # dotted path of the repeated decoder layers (an nn.ModuleList)
    final_norm: str | None = None  # the norm after them (sequence parallelism ends before it)
    # tensor parallelism: module-name pattern -> style, sizes that must divide, attention heads
    tensor_styles: Mapping[str, "str | Style"] = field(default_factory=dict)
    divisible: Mapping[str, int] = field(default_factory=dict)
    heads: int | None = None
    kv_heads: int | None = None
    hf_loss: bool = False  # a Hugging Face model whose loss_function must become vocabulary-parallel
    # expert parallelism: give the model only this rank's experts of each MoE layer, called
    # as expert_parallel(model, size=P, rank=p) (a Hugging Face Mixtral's: models/hf/experts.py)
    expert_parallel: Callable[..., None] | None = None
    # Ulysses sequence parallelism: how attention exchanges; inputs every layer gets whole
    ulysses: UlyssesAttention | None = None
    ulysses_split_kwargs: tuple[str, ...] = ()
    # pipeline parallelism: how one micro-batch runs through the first, middle and last stages
    pipeline: "Adapter | None" = None
    pipeline_refused: str | None = None  # why a family has no pipeline split and what to do instead
    # kernels: put the fused operators / a block-sparse attention layout into the model
    fused_ops: Callable[[nn.Module], None] | None = None
    sparse_attention: "Callable[[nn.Module, LayoutFactory], None] | None" = None
    # recomputation: which operator outputs a selectively checkpointed layer keeps
    selective_rule: str = "linear_outputs"
    # random-LTD: how a layer's other inputs (rotary tables, masks) are cut to the kept tokens
    # (runtime/data/random_ltd.py's KeptInputs); None: the layer takes the hidden states alone
    # (or only the config's model_mask_name)
    token_drop_inputs: "KeptInputs | None" = None

    def tensor_plan(self, styles: "Mapping[str, str | Style] | None" = None) -> TensorPlan:
        """The runtime's tensor-parallel plan; `styles` (a config's `tensor_parallel.plan`)
        replace the family's styles, keeping where its layers are."""
        return TensorPlan(dict(styles) if styles else dict(self.tensor_styles), self.layers, self.final_norm,
                          {} if styles else dict(self.divisible), self.heads, self.kv_heads, self.hf_loss)
