"""Building a rank's model, engine and data the same way for training and stage comparison."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch

from shardwise.tools.data import BlockSampler, load_tokens, split_tokens
from shardwise.runtime.activation.policy import RecomputePolicy
from shardwise.runtime.engine import Engine
from shardwise.runtime.parallel.expert.gating import capacity
from shardwise.runtime.parallel.expert.layer import MixtureOfExperts
from shardwise.models import GPT, GPTConfig
from shardwise.tools.profiling import PeakFlops, device_peak_flops
from shardwise.tools.train.expected import ExpertShape, RunShape, optimizer_state_bytes
from shardwise.tools.train.options import TrainOptions

BYTE_VOCABULARY = 256
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class ModelFacts:
    """Counted on the whole model before the engine partitions it (in stage 3 a
    partitioned parameter is empty afterwards). `tied_params` are elements of
    parameters used by more than one module, e.g. the embedding shared with the output."""

    num_params: int
    flops_per_token: int
    tied_params: int


def model_config(options: TrainOptions) -> GPTConfig:
    """The preset's depth and width, with a byte vocabulary, the training context and the
    MoE flags (`--moe-experts`, `--moe-top-k`, `--moe-every`, `--ep-size`)."""
    return replace(GPTConfig.preset(options.model_size), vocab_size=BYTE_VOCABULARY, block_size=options.seq_len,
                   moe_experts=options.moe_experts, moe_top_k=options.moe_top_k, moe_every=options.moe_every,
                   moe_ep_size=options.ep_size)


def build_model(options: TrainOptions) -> tuple[GPT, ModelFacts]:
    torch.manual_seed(options.seed)
    model = GPT(model_config(options))
    owners = Counter(id(param) for module in model.modules() for param in module.parameters(recurse=False))
    facts = ModelFacts(
        num_params=sum(param.numel() for param in model.parameters()),
        flops_per_token=model.flops_per_token(),
        tied_params=sum(param.numel() for param in model.parameters() if owners[id(param)] > 1),
    )
    return model, facts


def run_shape(engine: Engine, num_params: int) -> RunShape:
    """The formulas' inputs for this engine's settings (docs/formulas.md)."""
    cfg = engine.config
    dtype = DTYPE_NAMES[engine.dtype]
    optimizer = cfg.optimizer
    momentum = optimizer.params.get("momentum", 0.0) if optimizer is not None else 0.0
    bf16_masters = not engine.policies.precision.keeps_fp32_masters and dtype != "fp32"
    accumulation = DTYPE_NAMES[engine.policies.precision.accumulation_dtype]
    return RunShape(
        num_params=num_params,
        world_size=engine.world_size,
        stage=engine.stage,
        dtype=dtype,
        comm_dtype=cfg.communication_data_type or dtype,
        optimizer_state_bytes=optimizer_state_bytes(optimizer.type if optimizer else "AdamW", dtype, momentum,
                                                    bf16_masters=bf16_masters),
        persistent_params=engine.persistent_numel(),
        accumulation_steps=engine.gradient_accumulation_steps,
        optimizer_type=optimizer.type if optimizer else "AdamW",
        bf16_masters=bf16_masters,
        experts=expert_shape(engine),
        grad_dtype=accumulation if accumulation != dtype else None,
    )


def expert_shape(engine: Engine) -> ExpertShape | None:
    """The experts the engine trains apart (ep_size > 1), None without; C is the gate's
    capacity for a micro-batch of whole sequences on this rank (top-2: twice the factor);
    the recomputed MoE layers are those in the activation-checkpointing policy's regions
    (every policy, selective included, re-runs a region's forward, all-to-alls and all)."""
    if engine.experts is None:
        return None
    layers = [layer for layer in engine.module.modules()
              if isinstance(layer, MixtureOfExperts) and layer.expert_parallel_size > 1]
    sizes = {layer.expert_parallel_size for layer in layers}
    gates = {(layer.num_experts, layer.gate.k, layer.gate.capacity_factor, layer.gate.min_capacity) for layer in layers}
    if len(sizes) != 1 or len(gates) != 1:
        raise ValueError(f"the report's expert formulas take one ep_size and one gate for every MoE layer; this "
                         f"model has ep_sizes {sorted(sizes)} and gates (experts, k, factor, min) {sorted(gates)}")
    (ep_size,), ((experts, k, factor, min_capacity),) = sizes, gates
    config = engine.module.config
    tokens = engine.config.train_micro_batch_size_per_gpu * config.block_size
    block = engine.config.activation_checkpointing
    regions = RecomputePolicy(block.policy, block.every_k).regions(config.n_layer)
    return ExpertShape(
        params=ep_size * sum(param.numel() for _, param, _ in engine.experts.params),
        ep_size=ep_size,
        experts=experts,
        layers=len(layers),
        capacity=capacity(tokens, experts, factor * k, min_capacity),
        width=config.n_embd,
        recomputed_layers=sum(config.is_moe_block(index) for region in regions for index in region),
    )


def samplers(options: TrainOptions, global_batch: int) -> tuple[BlockSampler, BlockSampler]:
    """(train, validation) samplers over the cached corpus; validation uses its own seed."""
    train_tokens, val_tokens = split_tokens(load_tokens(options.corpus_path))
    return (
        BlockSampler(train_tokens, options.seq_len, global_batch, options.seed),
        BlockSampler(val_tokens, options.seq_len, global_batch, options.seed + 1),
    )


def shared_peak_flops(engine: Engine) -> PeakFlops:
    """Every rank measures at once (as they will train: sharing cores and memory
    bandwidth), and the ranks agree on the mean."""
    engine.comm.barrier("peak FLOP/s measurement")
    peak = device_peak_flops(engine.device, engine.dtype)
    total = torch.tensor([peak.flops_per_second], dtype=torch.float64, device=engine.device)
    engine.comm.control_all_reduce(total, "peak FLOP/s")
    return PeakFlops(float(total.item()) / engine.world_size, peak.source)
