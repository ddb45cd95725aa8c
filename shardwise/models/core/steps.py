"""A model's parallelisms, applied in one fixed order by explicit calls (`apply_plan`).

    expert parallel -> tensor parallel -> sequence parallel -> activation checkpointing
        -> kernels and compile -> random-LTD -> pipeline split  (then the engine's ZeRO takes the parameters)

Expert parallelism decides which experts a rank keeps (as the pipeline split decides which
layers, but the experts' module must be in place before tensor parallelism splits the
width of the experts kept and wraps them in its region); tensor parallelism replaces
weights with their local shards; sequence parallelism changes where activations are split
inside those layers; checkpointing wraps the (now parallel) layers; kernels and
compilation see the final layers; random-LTD wraps the finished layers (a recomputed
layer reruns on the tokens its forward kept); the pipeline
split decides which layers this rank keeps; ZeRO (the engine) partitions whatever
parameters remain. The order is torchtitan's. Each step is a runtime function that can
also be called on its own; what a step needs to know about the model comes from the
model's `ModelPlan` (plan.py): its family's (shardwise/models/gpt/, shardwise/models/hf/),
or one the user writes.
"""

from __future__ import annotations

import logging
from typing import Mapping

from torch import nn

from shardwise.models.core.plan import ModelPlan
from shardwise.runtime.activation import CheckpointStore, RegionStats, apply_activation_checkpointing
from shardwise.runtime.compile import compile_blocks
from shardwise.runtime.data.random_ltd import RandomLTDState, wrap_layers
from shardwise.runtime.distributed.collectives import Communicator, mesh_communicator
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.engine.policies import Policies
from shardwise.runtime.ops.sparse_attention import seeded_layout
from shardwise.runtime.parallel.expert.layer import shard_expert_layers
from shardwise.runtime.parallel.expert.tensor_split import split_experts_by_tensor_group
from shardwise.runtime.parallel.pipeline.stages import split_pipeline
from shardwise.runtime.parallel.sequence.megatron import apply_megatron_sequence_parallel
from shardwise.runtime.parallel.sequence.ulysses import apply_ulysses
from shardwise.runtime.parallel.tensor.layers import TensorRegion
from shardwise.runtime.parallel.tensor.transform import apply_tensor_parallel
from shardwise.runtime.parallel.tensor.styles import Style
from shardwise.runtime.base.torch_compat import require_selective_policy_outputs

log = logging.getLogger("shardwise")
KNOWN = ("shardwise GPT, Hugging Face llama, mistral, qwen2, qwen3, gpt2, and models laid out like them "
         "(gemma, gemma2, gemma3, phi3, mixtral, falcon, bert, roberta, t5; models/hf/)")
GUIDE = "docs/parallelism.md#your-own-model"


def apply_plan(model: nn.Module, plan: ModelPlan, *, mesh: ParallelMesh, policies: Policies,
               tensor_styles: Mapping[str, str | Style] | None = None, world: Communicator | None = None
               ) -> nn.Module:
    """Apply `policies`' parallelisms to `model` over `mesh` as `plan` says, in the fixed
    order; returns the model ZeRO will partition (the same object, rewritten).
    `tensor_styles`: a config's `tensor_parallel.plan`, replacing the plan's styles.
    `world`: every rank, for steps whose ranks must agree (a pipeline split by measured time)."""
    apply_expert_step(model, plan, mesh=mesh, policies=policies)
    apply_tensor_step(model, plan, mesh=mesh, policies=policies, tensor_styles=tensor_styles)
    apply_sequence_step(model, plan, mesh=mesh, policies=policies)
    apply_activation_step(model, plan, mesh=mesh, policies=policies)
    apply_kernel_and_compile_step(model, plan, policies=policies)
    apply_random_ltd_step(model, plan, mesh=mesh, policies=policies)
    apply_pipeline_step(model, plan, mesh=mesh, policies=policies, world=world)
    return model


def apply_expert_step(model: nn.Module, plan: ModelPlan, *, mesh: ParallelMesh, policies: Policies) -> None:
    """This rank's experts of each mixture-of-experts layer, the expert group carved from its
    data-parallel group (the engine connects the layers to the group and trains the experts
    apart): layers that carry their own ep_size P > 1 (shardwise's and DeepSpeed's MoE) keep
    their E/P experts; with `expert_parallel` on, the plan spreads a model's own experts
    (Hugging Face Mixtral's stacked ones)."""
    shard_expert_layers(model, mesh)
    if not policies.expert.enabled:
        return
    if plan.expert_parallel is None:
        raise ValueError(f"expert_parallel.autoep_size {policies.expert.size}: shardwise does not know how to spread "
                         f"{type(model).__name__}'s experts (built in: Hugging Face models with Mixtral's stacked "
                         "experts; DeepSpeed's MoE layers and shardwise GPT's MoE blocks take ep_size themselves); "
                         f"disable expert_parallel, or give a ModelPlan with `expert_parallel` ({GUIDE})")
    expert, _ = mesh.expert_handles(policies.expert.size)
    plan.expert_parallel(model, size=policies.expert.size, rank=expert.rank)


def apply_tensor_step(model: nn.Module, plan: ModelPlan, *, mesh: ParallelMesh, policies: Policies,
                      tensor_styles: Mapping[str, str | Style] | None = None) -> None:
    """Tensor parallelism, then Megatron sequence parallelism inside the tensor group."""
    if not policies.tensor.enabled:
        return
    if not (tensor_styles or plan.tensor_styles):
        raise ValueError(
            f"tensor_parallel.plan: shardwise has no tensor-parallel plan for {type(model).__name__} (built in: "
            f"{KNOWN}); give one as tensor_parallel.plan = "
            '{"module.name.pattern": "colwise" | "rowwise" | ...}, or a ModelPlan (' + GUIDE + ")"
        )
    region = TensorRegion(mesh_communicator(mesh, "tensor"), policies.tensor.sequence_parallel)
    tensor_plan = plan.tensor_plan(tensor_styles)
    apply_tensor_parallel(model, region, tensor_plan)
    split_experts_by_tensor_group(model, region)  # mixtures of experts built to be (DeepSpeed's flag)
    if region.sequence_parallel:
        apply_megatron_sequence_parallel(model, tensor_plan, region)


def apply_sequence_step(model: nn.Module, plan: ModelPlan, *, mesh: ParallelMesh, policies: Policies) -> None:
    """Ulysses: the decoder runs on 1/S of the positions; attention exchanges them for heads.
    Nothing to do when the caller shards the inputs and wrapped attention itself."""
    if not policies.sequence.enabled or policies.sequence.sharded_by_caller:
        return
    if plan.ulysses is None:
        raise ValueError(f"sequence_parallel.size > 1: shardwise does not know how {type(model).__name__}'s "
                         f"attention exchanges sequence for heads (built in: {KNOWN}); give a ModelPlan with "
                         f"`ulysses` and `layers` ({GUIDE})")
    apply_ulysses(model, mesh_communicator(mesh, "sequence"), plan.tensor_plan(), exchange_in_attention=plan.ulysses,
                  split_kwargs=plan.ulysses_split_kwargs, tensor_size=policies.tensor.size)


def apply_activation_step(model: nn.Module, plan: ModelPlan, *, mesh: ParallelMesh, policies: Policies) -> None:
    """Recomputation of the layers by the policy, inputs kept where it says (Pa, CPU, Md)."""
    activation = policies.activation
    if activation.partition_activations and not policies.tensor.enabled:
        log.info("shardwise: activation_checkpointing.partition_activations has no effect with a tensor-parallel "
                 "group of one rank (tensor_parallel.size 1): checkpoints are kept whole")
    if not activation.recomputes:
        return
    tensor = mesh_communicator(mesh, "tensor") if policies.tensor.enabled else None
    apply_activation_checkpointing(
        model, activation.recompute, layers=plan.layers, store=CheckpointStore.for_policy(activation, tensor),
        selective=plan.selective_rule, stats=RegionStats() if activation.profile else None,
        synchronize=activation.synchronize,
    )


def apply_kernel_and_compile_step(model: nn.Module, plan: ModelPlan, *, policies: Policies) -> None:
    """The family's fused operators and block-sparse attention, then `torch.compile` per layer."""
    kernels = policies.kernels
    if kernels.sparse_attention is not None:
        _require(plan.sparse_attention, model, "sparse_attention")
        with seeded_layout(kernels.layout_seed):  # random blocks alike on every rank, with no collective
            plan.sparse_attention(model, kernels.sparse_attention)
    if kernels.fused_ops:
        _require(plan.fused_ops, model, "compile.fused_ops")
        plan.fused_ops(model)
    if policies.compile.enabled:
        if policies.activation.recompute.name == "selective":
            require_selective_policy_outputs('compile.enabled with activation_checkpointing.policy "selective"')
        blocks = list(model.get_submodule(plan.layers)) if plan.layers else None
        compile_blocks(model, policies.compile, blocks)


def apply_random_ltd_step(model: nn.Module, plan: ModelPlan, *, mesh: ParallelMesh, policies: Policies) -> None:
    """Data efficiency's random-LTD: the chosen layers run on a random subset of the tokens.
    A model whose plan does not say where its layers are is left to DeepSpeed's API
    (`convert_to_random_ltd(engine, LayerClass)` after initialize), as DeepSpeed scripts do."""
    policy = policies.random_ltd
    if policy is None:
        return
    if plan.layers is None:  # the caller wraps them (convert_to_random_ltd); else the engine's forward refuses
        return
    splits = [name for name, on in (("pipeline_parallel", policies.pipeline.enabled),
                                    ("sequence_parallel", policies.sequence.enabled),
                                    ("tensor_parallel.sequence_parallel", policies.tensor.sequence_parallel)) if on]
    if splits:
        raise ValueError(f"data_efficiency.data_routing.random_ltd with {', '.join(splits)}: random-LTD draws each "
                         "sample's kept tokens over the whole sequence in its first dropping layer, which a split "
                         "sequence or a pipeline stage without that layer does not have; use data and tensor "
                         "parallelism with ZeRO")
    wrap_layers(model.get_submodule(plan.layers), RandomLTDState(policy, data_rank=mesh.data_rank),
                plan.token_drop_inputs)


def apply_pipeline_step(model: nn.Module, plan: ModelPlan, *, mesh: ParallelMesh, policies: Policies,
                        world: Communicator | None = None) -> None:
    """Keep this rank's stage of the layers."""
    if not policies.pipeline.enabled:
        return
    if plan.pipeline is None and plan.pipeline_refused:
        raise ValueError(f"pipeline_parallel.size > 1: {plan.name} ({type(model).__name__}) is not split into "
                         f"stages: {plan.pipeline_refused} ({GUIDE})")
    if plan.pipeline is None:
        raise ValueError(
            f"pipeline_parallel.size > 1: shardwise does not know how to split {type(model).__name__} into stages "
            f"(supported: {KNOWN} causal LMs, and a list of layers in "
            "shardwise.runtime.parallel.pipeline.SequentialStages or DeepSpeed's PipelineModule); use "
            f"pipeline_parallel.size 1 for this model, or give a ModelPlan with a pipeline Adapter ({GUIDE})"
        )
    split_pipeline(model, plan.pipeline, pipeline=mesh["pipeline"], policy=policies.pipeline,
                   micro_batch_size=policies.training.micro_batch_size, world=world)


def _require(rewrite: object, model: nn.Module, key: str) -> None:
    if rewrite is None:
        raise ValueError(f"{key}: shardwise can rewrite its own GPT and Hugging Face Llama models, not "
                         f"{type(model).__name__}; remove the key, or apply shardwise.runtime.ops' modules to the "
                         f"model yourself ({GUIDE})")
