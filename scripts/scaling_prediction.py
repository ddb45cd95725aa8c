"""The 70B table (and plot) of docs/scaling.md: where shardwise would stand at 1,024 and
4,096 H100s, predicted by the time model (shardwise/tools/planner/timing.py).

    .venv/bin/python scripts/scaling_prediction.py                       # the markdown table
    .venv/bin/python scripts/scaling_prediction.py --plot docs/scaling_70b.svg

Regenerate both whenever the time model changes; the page is never edited by hand.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shardwise.formulas.model_shape import ModelShape
from shardwise.formulas.parallel_activation import ModelParallel
from shardwise.formulas.step_time import training_flops_per_token
from shardwise.tools.planner.devices import datasheet
from shardwise.tools.planner.timing import Plan, Prediction, predict

# Llama-2-70B's shape; Ψ = 12·L·h² + 2·V·h
LAYERS, HIDDEN, HEADS, VOCAB, SEQ_LEN = 80, 8192, 64, 32000, 4096
PSI = 12 * LAYERS * HIDDEN**2 + 2 * VOCAB * HIDDEN
SHAPE = ModelShape("Llama-2-70B shape", PSI, HIDDEN, LAYERS, HEADS, VOCAB)
GPUS_PER_NODE = 8
DEVICE = "h100"


@dataclass(frozen=True)
class Layout:
    name: str
    stage: int
    recompute: str
    tensor: int = 1
    pipeline: int = 1

    def plan(self, gpus: int) -> Plan:
        """Micro-batch 1 and a global batch of one sequence per GPU."""
        parallel = ModelParallel(tensor=self.tensor, pipeline=self.pipeline, megatron_sp=self.tensor > 1)
        return Plan(self.stage, recompute=self.recompute, parallel=parallel, micro_batch=1,
                    accumulation=self.tensor * self.pipeline)


LAYOUTS = (
    Layout("ZeRO-3", 3, "full"),
    Layout("ZeRO-3 + TP8", 3, "selective", tensor=8),
    Layout("ZeRO-1 + TP8 + PP4", 1, "selective", tensor=8, pipeline=4),
    Layout("ZeRO-1 + TP8 + PP8", 1, "selective", tensor=8, pipeline=8),
)
GPU_COUNTS = (1024, 4096)


def predictions() -> list[tuple[int, Layout, Prediction]]:
    speeds = datasheet(DEVICE)
    return [(gpus, layout, predict(SHAPE, layout.plan(gpus), speeds, num_gpus=gpus, gpus_per_node=GPUS_PER_NODE,
                                   seq_len=SEQ_LEN, dtype="bf16", optimizer_state_bytes=12))
            for gpus in GPU_COUNTS for layout in LAYOUTS]


def model_tflops_per_gpu(prediction: Prediction, gpus: int) -> float:
    """Model FLOPs (no recomputation counted) per second per GPU."""
    per_token = training_flops_per_token(PSI, layers=LAYERS, hidden=HIDDEN, seq_len=SEQ_LEN)
    return per_token * prediction.tokens_per_s / gpus / 1e12


def table() -> str:
    peak = datasheet(DEVICE).peak_flops / 1e12
    lines = ["| GPUs | plan | recompute | global batch (seq) | A | step s | tokens/s | TFLOP/s per GPU | MFU | "
             "compute / bubble / comm / update s |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for gpus, layout, prediction in predictions():
        time, plan = prediction.time, prediction.plan
        tflops = model_tflops_per_gpu(prediction, gpus)
        lines.append(f"| {gpus} | {layout.name} | {layout.recompute} | {prediction.tokens_per_step // SEQ_LEN} | "
                     f"{plan.accumulation} | {prediction.step_s:.2f} | {prediction.tokens_per_s / 1e6:.2f} M | "
                     f"{tflops:.0f} | {100 * tflops / peak:.0f}% | {time.compute:.2f} / {time.bubble:.2f} / "
                     f"{time.exposed_comm:.2f} / {time.optimizer:.3f} |")
    return "\n".join(lines)


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "scaling"  # the same file for the same numbers
    import matplotlib.pyplot as plt

    rows = predictions()
    figure, axes = plt.subplots(figsize=(7, 3.6))
    width = 0.2
    for index, layout in enumerate(LAYOUTS):
        values = [model_tflops_per_gpu(p, gpus) for gpus, lay, p in rows if lay is layout]
        axes.bar([g + (index - 1.5) * width for g in range(len(GPU_COUNTS))], values, width, label=layout.name)
    axes.set_xticks(range(len(GPU_COUNTS)), [f"{g:,} H100" for g in GPU_COUNTS])
    axes.set_ylabel("model TFLOP/s per GPU (predicted)")
    axes.set_title("70B, 4,096-token sequences, one sequence per GPU per step")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, metadata={"Date": None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, help="also write the bar chart here (SVG or PNG)")
    args = parser.parse_args()
    print(table())
    if args.plot:
        plot(args.plot)


if __name__ == "__main__":
    main()
