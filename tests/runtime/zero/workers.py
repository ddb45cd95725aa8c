"""Training runs shared by the ZeRO tests: a parallel run (one call per rank) and the
single-process reference it must match (docs/development.md#how-shardwise-is-tested: same global batch, same losses, same
final weights).

Both start from the same seeded model and see the same global batches: at step s the
global batch has world * accumulation * micro rows, and rank r's micro-batch m is rows
[(m * world + r) * micro, ...). The reference trains on the whole global batch at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

import shardwise
from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.policies import precision_policy
from shardwise.models import GPT, GPTConfig
from shardwise.runtime.optim.adafactor import Adafactor
from shardwise.runtime.optim.adam8bit import Adam8bit, AdamW8bit
from shardwise.runtime.optim.lars import Lars
from shardwise.runtime.optim.muon import Muon
from shardwise.runtime.optim.zero_gradient_step import step_on_zero_gradients


@dataclass(frozen=True, eq=False)
class Case:
    stage: int = 2
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    accumulation: int = 1
    micro_batch: int = 2
    steps: int = 3
    clipping: float = 0.05
    lr: float = 1e-2
    model: str = "gpt"  # gpt | llama | gpt2
    bucket_size: int = 3000  # elements: several buckets even for the tiny model
    extra_config: dict = field(default_factory=dict)
    optimizer: str = "adamw"  # a key of OPTIMIZERS

    def config(self, world_size: int) -> dict:
        config = {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "gradient_clipping": self.clipping,
            "zero_optimization": {
                "stage": self.stage,
                "reduce_bucket_size": self.bucket_size,
                "allgather_bucket_size": self.bucket_size,
                "overlap_comm": True,
            },
            "bf16": {"enabled": self.dtype == "bf16"},
            "fp16": {"enabled": self.dtype == "fp16"},
        }
        for key, value in self.extra_config.items():
            if isinstance(value, dict):
                config.setdefault(key, {}).update(value)
            else:
                config[key] = value
        return config


SEQ_LEN = 16
VOCAB = 64


def build_model(kind: str) -> torch.nn.Module:
    """Seeded, identical on every rank. No attention biases: a key bias gets an exactly
    zero true gradient, so Adam turns its rounding noise into O(lr) updates that no two
    summation orders reproduce."""
    torch.manual_seed(1234)
    if kind in ("gpt", "gpt-untied"):
        tie = kind == "gpt"
        return GPT(dataclasses.replace(GPTConfig.preset("tiny"), bias=False, tie_embeddings=tie))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                tie_word_embeddings=True,
            )
        )
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ_LEN,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            )
        )
    raise ValueError(kind)


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def model_loss(model, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind.startswith("gpt") and kind != "gpt2":
        return model(x, y)
    logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _lamb(groups: list[dict], lr: float) -> torch.optim.Optimizer:
    from shardwise.runtime.optim.lamb import Lamb

    return Lamb(groups, lr=lr)


def _shardwise(cls: type[torch.optim.Optimizer], **options) -> Callable[[list[dict], float], torch.optim.Optimizer]:
    """One of shardwise's own optimizers with test settings."""
    return lambda groups, lr: cls(groups, lr=lr, **options)


# Adam's step is m/(√v + eps): for a gradient entry whose sum is within rounding of zero it
# is about g/(|g| + eps), whose slope 1/eps turns a last-bit difference in g (summation
# order, another CPU's BLAS) into a step difference of lr·δ/eps. Measured on the hybrid
# sharding cases (worst relative weight error against one process, this CPU / with
# ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE standing in for another): torch's 1e-8
# gives 6.6e-6 / 1.2e-5, over the equivalence tests' 1e-5 on the other CPU; 1e-6 gives
# 3.4e-6 / 1.0e-6; 1e-4 gives 2.2e-7 on both, which leaves the tolerance to real errors.
ADAM_EPS = 1e-4

OPTIMIZERS = {
    "adamw": lambda groups, lr: torch.optim.AdamW(groups, lr=lr, eps=ADAM_EPS),
    # a step proportional to the gradient: a test of how gradients are scaled (Adam's step is not)
    "sgd": lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9),
    "lamb": _lamb,
    # a trust coefficient large enough that the trust ratio shapes the step at lr 1e-2
    "lars": _shardwise(Lars, momentum=0.9, trust_coefficient=0.05),
    "adafactor": _shardwise(Adafactor),
    # 1024: the tiny GPT's matrices are quantised (their blocks cut by pieces), its vectors are not
    "adam8bit": _shardwise(Adam8bit, min_8bit_size=1024),
    "adamw8bit": _shardwise(AdamW8bit, min_8bit_size=1024),
    # Newton-Schulz in fp32: in bf16 the last-bit gradient differences of data parallelism
    # flip roundings, which the iteration spreads over the whole update (~1e-3 relative)
    "muon": _shardwise(Muon, adam_lr=3e-3, ns_dtype="float32"),
}


def make_optimizer(model: torch.nn.Module, lr: float, kind: str = "adamw") -> torch.optim.Optimizer:
    """Two param groups (decay / no decay), as real training scripts build them."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return OPTIMIZERS[kind](groups, lr)


def train_parallel(rank: int, world_size: int, case: Case) -> dict:
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world_size),
                                  optimizer=make_optimizer(model, case.lr, case.optimizer))
    rows = world_size * case.accumulation * case.micro_batch
    losses = []
    for step in range(case.steps):
        x, y = global_batch(step, rows)
        step_loss = torch.zeros(())
        for micro in range(case.accumulation):
            start = (micro * world_size + rank) * case.micro_batch
            rows_here = slice(start, start + case.micro_batch)
            inputs, targets = x[rows_here].to(engine.device), y[rows_here].to(engine.device)
            loss = model_loss(engine, case.model, inputs, targets)
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float().cpu()
        losses.append(step_loss / case.accumulation)
    comm = engine.comm_volume()
    comm_by_group = engine.comm_volume(per_group=True)
    layout = _stage3_layout(engine) if engine.stage == 3 else {}
    losses = engine.comm.control_all_reduce(torch.stack(losses), "test losses")
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}
    return {
        "losses": (losses / world_size).tolist(),
        "params": params,
        "memory": engine.memory_breakdown(),
        "memory_by_tier": engine.memory_breakdown(by_tier=True),
        "comm": comm,
        "comm_by_group": comm_by_group,
        "numel": engine.num_parameters(),
        "padding": engine.padding_elements(),
        "tied": _has_tied_embeddings(model),
        "units": len(engine.units),
        "largest_unit": max(unit.padded_numel for unit in engine.units),
        **layout,
    }


def _stage3_layout(engine) -> dict:
    persistent = engine.zero.params.replicated.units
    return {
        "persistent_padded": sum(unit.padded_numel for unit in persistent),
        "partitioned_padded": sum(unit.padded_numel for unit in engine.zero.params.sharded.units),
        "peak_gathered": engine.zero.params.sharded.peak_gathered_numel,
    }


def _has_tied_embeddings(model: torch.nn.Module) -> bool:
    named = list(model.named_parameters(remove_duplicate=False))
    return len(named) > len({id(p) for _, p in named})


def train_reference(case: Case, world_size: int, per_micro_batch: bool = False) -> dict:
    """Plain PyTorch, one process, fp32, the same global batch per step.

    By default the whole global batch goes through one forward. `per_micro_batch` instead
    accumulates the micro-batches one by one (rank-major, like the ranks' sum): the same
    mathematics, with the summation order of data parallelism, for models whose
    zero-gradient parameters (GPT-2's key bias) turn rounding noise into Adam updates.
    """
    model = build_model(case.model)
    optimizer = make_optimizer(model, case.lr, case.optimizer)
    if takes_initial_zero_gradient_step(case, world_size):
        step_on_zero_gradients(optimizer)
    rows = world_size * case.accumulation * case.micro_batch
    losses = []
    for step in range(case.steps):
        x, y = global_batch(step, rows)
        if per_micro_batch:
            loss = torch.zeros(())
            for rank in range(world_size):
                for micro in range(case.accumulation):
                    start = (micro * world_size + rank) * case.micro_batch
                    rows_here = slice(start, start + case.micro_batch)
                    part = model_loss(model, case.model, x[rows_here], y[rows_here])
                    (part / (world_size * case.accumulation)).backward()
                    loss = loss + part.detach() / (world_size * case.accumulation)
        else:
            loss = model_loss(model, case.model, x, y)
            loss.backward()
        if case.clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def takes_initial_zero_gradient_step(case: Case, world_size: int) -> bool:
    """Whether the case's config has the optimizer stepped once on zero gradients when it is
    built, as DeepSpeed's FP16_Optimizer does in 16-bit training without ZeRO
    (runtime/optim/zero_gradient_step.py): the reference then takes that step too."""
    config = load_config(case.config(world_size), world_size=world_size)
    return precision_policy(config).initial_zero_gradient_step


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def assert_matches_reference(result: dict, reference: dict, tolerance: float) -> None:
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        error = abs(got - want) / abs(want)
        assert error < tolerance, f"step {step} loss {got} vs reference {want} (rel err {error:.2e})"
    for name, want in reference["params"].items():
        error = relative_error(result["params"][name], want)
        assert error < tolerance, f"{name}: relative error {error:.2e} >= {tolerance}"
