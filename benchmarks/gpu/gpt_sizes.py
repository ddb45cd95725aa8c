"""The largest GPT that fits a device, chosen from shardwise's memory formulas, not by trial.

A trial-and-error search costs an out-of-memory crash per try (and a fresh process), which
the lent GPU's minutes cannot pay for. The formulas the planner and the tests share
(shardwise/planner) give every term of a training step's peak for shardwise's GPT
(shardwise/models/gpt.py: tied embedding, biases, flash attention, no dropout):

    model states     placed_model_state_bytes (docs/formulas.md, offload placement): 16Ψ for bf16 +
                     Adam without offload; plain PyTorch with autocast holds fp32 weights,
                     fp32 gradients, Adam's two fp32 moments and autocast's bf16 weight
                     copies: 18Ψ
    optimizer step   the engine steps `sub_group_size` elements at a time: their fp32
                     gradient copy and foreach Adam's temporaries, 3 x 4 bytes x sub-group
    stage-3 gathers  stage3_gather_bytes: a block gathered, the next prefetched, its gradient
    activations      shardwise/formulas/activation.py per layer (flash attention keeps no s^2 term:
                     32·sbh in bf16 without dropout), for the recomputation policy
    head             the final norm's and output layer's inputs, and the logits: bf16, their
                     fp32 copy and its log-softmax, the gradient in backward (14·sbV)
    fixed            CUDA context, cuBLAS and compile workspaces (`--workspace-gib`)

and the largest number of layers whose predicted peak is within `--fraction` of the
device's memory is the size. Each benchmark reports the measured peak beside this
prediction, so one GPU run calibrates the formulas.

    python3 benchmarks/gpu/gpt_sizes.py --memory-gib 79.6 --variants plain stage0 stage3
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field

import harness  # noqa: F401  (puts the repository on sys.path)

from shardwise.formulas.activation import LayerShape, activation_peak_bytes, head_bytes, layer_activation_bytes
from shardwise.formulas.memory import Offload, placed_model_state_bytes
from shardwise.formulas.layers import stage3_gather_bytes

GIB = 2**30
BF16 = 2
ADAM_TRANSIENT_COPIES = 3  # fp32 gradient copy + two foreach temporaries per sub-group element
LOGIT_BYTES = 14  # per s·b·V element: bf16 logits, fp32 copy, log-softmax, fp32 and bf16 gradients
DEFAULT_SUB_GROUP = 200_000_000
VARIANTS = ("plain", "stage0", "stage3", "offload_cpu", "offload_nvme")


@dataclass(frozen=True)
class Shape:
    """A GPT's size: width, heads, vocabulary and the sequence it trains on."""

    hidden: int
    heads: int
    vocab: int
    seq_len: int
    micro_batch: int

    def block_params(self) -> int:
        """Two LayerNorms (2h each), QKV 3h² + 3h, projection h² + h, MLP 8h² + 5h."""
        h = self.hidden
        return 12 * h * h + 13 * h

    def num_params(self, layers: int) -> int:
        """Token and position embeddings (the output layer is tied), blocks, final norm."""
        h = self.hidden
        return self.vocab * h + self.seq_len * h + layers * self.block_params() + 2 * h

    def layer(self) -> LayerShape:
        return LayerShape(self.seq_len, self.micro_batch, self.hidden, self.heads, element_bytes=BF16,
                          dropout=False, attention_core=False)


@dataclass
class Plan:
    """The chosen size and its predicted peak per variant, term by term."""

    layers: int
    num_params: int
    budget_bytes: int
    predicted: dict[str, dict[str, int]] = field(default_factory=dict)

    def peak(self, variant: str) -> int:
        return sum(self.predicted[variant].values())


def predicted_terms(shape: Shape, layers: int, variant: str, recompute: str = "none",
                    sub_group_size: int = DEFAULT_SUB_GROUP, workspace_bytes: int = 0) -> dict[str, int]:
    """Device bytes at the step's peak, per term, for one variant (see the module doc)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    psi = shape.num_params(layers)
    terms: dict[str, int] = {}
    if variant == "plain":
        terms["model_states"] = 18 * psi
    else:
        stage = 0 if variant == "stage0" else 3
        offload = {"offload_cpu": Offload(optimizer="cpu"), "offload_nvme": Offload(optimizer="nvme", params="nvme")}
        placed = placed_model_state_bytes(psi, 1, stage, offload.get(variant, Offload()), dtype="bf16")
        terms["model_states"] = sum(placed["gpu"].values())
        if variant in ("stage0", "stage3"):
            terms["optimizer_step"] = ADAM_TRANSIENT_COPIES * 4 * min(sub_group_size, psi)
        if stage == 3:
            terms["stage3_gathers"] = stage3_gather_bytes(shape.block_params(), "bf16")
    layer = shape.layer()
    if recompute == "none":
        terms["activations"] = layers * layer_activation_bytes(layer)
    elif recompute == "full":
        terms["activations"] = activation_peak_bytes(layer, layers, [range(i, i + 1) for i in range(layers)])
    else:
        raise ValueError(f"recompute must be none or full, got {recompute!r}")
    s_b_v = shape.seq_len * shape.micro_batch * shape.vocab
    terms["head"] = head_bytes(layer, shape.vocab) - 4 * s_b_v + LOGIT_BYTES * s_b_v
    terms["workspace"] = workspace_bytes
    return terms


def largest_fitting(shape: Shape, memory_bytes: int, variants: list[str], fraction: float = 0.9,
                    workspace_bytes: int = int(1.5 * GIB), recompute: str = "none",
                    sub_group_size: int = DEFAULT_SUB_GROUP, max_layers: int = 512) -> Plan:
    """The most layers for which every variant's predicted peak is within `fraction` of
    `memory_bytes`; raises ValueError when not even one layer fits."""
    budget = int(fraction * memory_bytes)

    def terms(layers: int) -> dict[str, dict[str, int]]:
        return {variant: predicted_terms(shape, layers, variant, recompute, sub_group_size, workspace_bytes)
                for variant in variants}

    def fits(layers: int) -> bool:
        return all(sum(t.values()) <= budget for t in terms(layers).values())

    if not fits(1):
        one = max(sum(t.values()) for t in terms(1).values())
        raise ValueError(f"not even one layer fits: {one / GIB:.2f} GiB predicted for {variants} at "
                         f"{shape}, budget {budget / GIB:.2f} GiB")
    low, high = 1, max_layers  # the peak grows with the layers: bisect
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return Plan(low, shape.num_params(low), budget, terms(low))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-gib", type=float, required=True, help="device memory (an H100: 79.6)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.9)
    parser.add_argument("--workspace-gib", type=float, default=1.5)
    parser.add_argument("--recompute", choices=("none", "full"), default="none")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["plain", "stage0", "stage3"])
    args = parser.parse_args()
    shape = Shape(args.hidden, args.heads, args.vocab, args.seq_len, args.micro_batch)
    plan = largest_fitting(shape, int(args.memory_gib * GIB), args.variants, args.fraction,
                           int(args.workspace_gib * GIB), args.recompute)
    print(json.dumps({"shape": asdict(shape), **asdict(plan),
                      "predicted_peak_gib": {v: round(plan.peak(v) / GIB, 2) for v in args.variants}}))


if __name__ == "__main__":
    main()
