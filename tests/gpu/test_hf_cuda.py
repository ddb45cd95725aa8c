"""A Hugging Face Llama on CUDA (C24, C27): trained by the engine at ZeRO-2 and 3 with
gradient accumulation, in fp32 and bf16, against the fp32 CPU reference
(tests/runtime/zero/test_hf_models.py's model and reference); and ShardwiseTrainer on CUDA
against plain transformers.Trainer on the CPU (tests/integrations' runs)."""

import pytest

from shardwise.tools.testing import run_distributed
from tests.gpu.ranks import train_cases
from tests.gpu.target import DEVICE, LR, TOLERANCE, WORLD, launch_once, needs_target, run_ranks
from tests.runtime.zero.test_hf_models import PARTITION_EVERYTHING
from tests.runtime.zero.workers import Case, assert_matches_reference, train_reference

pytestmark = needs_target
pytest.importorskip("transformers", reason="the GPU machine has no network: transformers comes as a carried wheel")

CASES = {
    "stage2": Case(model="llama", stage=2, accumulation=2, lr=LR),
    "stage3": Case(model="llama", stage=3, accumulation=2, lr=LR, extra_config=PARTITION_EVERYTHING),
    "stage3-bf16": Case(model="llama", stage=3, dtype="bf16", accumulation=2, lr=LR,
                        extra_config=PARTITION_EVERYTHING),
}


@launch_once
def llama_runs() -> list[list[dict]]:
    return run_ranks(train_cases, list(CASES.values()))


@pytest.mark.parametrize("name", list(CASES))
def test_llama_matches_the_fp32_reference(name):
    """The reference sums the micro-batches in the engine's order (tests/runtime/zero/workers.py)."""
    expected = train_reference(Case(model="llama", accumulation=2, lr=LR), WORLD, per_micro_batch=True)
    for runs in llama_runs():
        run = runs[list(CASES).index(name)]
        assert run["device"] == DEVICE and run["tied"]
        assert_matches_reference(run, expected, TOLERANCE[CASES[name].dtype])


def test_shardwise_trainer_on_cuda_equals_plain_trainer_on_cpu(tmp_path):
    """ZeRO-3 with the model's own gradient checkpointing (tests/frontends/hf_trainer/test_hf_trainer.py):
    logged losses, learning rates, gradient norms and eval losses, and the final logits."""
    from tests.frontends.hf_trainer.test_hf_trainer import STEPS, assert_logs_match, relative_error
    from tests.frontends.hf_trainer.workers import Run, train_reference as trainer_reference, train_shardwise

    expected = run_distributed(trainer_reference, 1, Run(out_dir=str(tmp_path / "reference")), timeout=240,
                               env={"CUDA_VISIBLE_DEVICES": ""})[0]
    results = run_ranks(train_shardwise, Run(out_dir=str(tmp_path / "stage3"), stage=3, activation_checkpointing=True),
                        timeout=240)
    for result in results:
        assert (result["stage"], result["world_size"], result["recomputes"]) == (3, WORLD, True)
        assert sorted(result["loss"]) == STEPS
        assert_logs_match(result, expected, STEPS)
        assert relative_error(result["logits"], expected["logits"]) < 1e-5
