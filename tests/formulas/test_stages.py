"""The stage questions against the ZeRO table (docs/formulas.md#model-states-per-rank)."""

import pytest

from shardwise.formulas.memory import model_state_bytes
from shardwise.formulas.stages import (
    STAGES,
    gathers_updated_parameters,
    keeps_full_gradients,
    partitions_gradients,
    partitions_optimizer,
    partitions_parameters,
)

# stage: (optimizer states, gradients, 16-bit parameters) partitioned
TABLE = {0: (False, False, False), 1: (True, False, False), 2: (True, True, False), 3: (True, True, True)}


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_partitions_what_the_table_says(stage: int) -> None:
    assert (partitions_optimizer(stage), partitions_gradients(stage), partitions_parameters(stage)) == TABLE[stage]
    assert keeps_full_gradients(stage) == (stage in (0, 1))
    assert gathers_updated_parameters(stage) == (stage in (1, 2))


@pytest.mark.parametrize("stage", STAGES)
def test_the_questions_agree_with_the_memory_formula(stage: int) -> None:
    psi, n = 1_000, 4
    states = model_state_bytes(psi, n, stage, "bf16", 12)
    assert states["optimizer_states"] == (12 * psi // n if partitions_optimizer(stage) else 12 * psi)
    assert states["grads"] == (2 * psi // n if partitions_gradients(stage) else 2 * psi)
    assert states["params"] == (2 * psi // n if partitions_parameters(stage) else 2 * psi)


@pytest.mark.parametrize("stage", [-1, 4, None, "3"])
def test_a_stage_that_does_not_exist_is_refused(stage) -> None:
    for question in (partitions_optimizer, partitions_gradients, partitions_parameters, keeps_full_gradients,
                     gathers_updated_parameters):
        with pytest.raises(ValueError, match="stage must be one of"):
            question(stage)
