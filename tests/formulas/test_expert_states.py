"""The experts' model states and gradient traffic under expert parallelism, by hand
(the engine's own count is compared with them in tests/tools/train/test_train_experts.py)."""

import pytest

from shardwise.formulas.communication import expert_gradient_bytes
from shardwise.formulas.memory import expert_model_state_bytes


def test_experts_whole_on_their_ranks_are_priced_like_dense_parameters_at_stage_0():
    # the tiny GPT's 2 local experts x 2 MoE layers of 8,352 elements, fp32 Adam, no expert-data partner
    states = expert_model_state_bytes(bucket_numels=[33_408], expert_data_size=1, stage=1, dtype="fp32",
                                      state_bytes_per_element=8)
    assert states == {"params": 133_632, "grads": 133_632, "optimizer_states": 267_264}


def test_a_partitioned_bucket_is_padded_and_its_gradient_slice_kept_in_fp32():
    # bf16, 1,001 elements over 2 ranks: padded to 1,002, a slice of 501
    states = expert_model_state_bytes(bucket_numels=[1001], expert_data_size=2, stage=2, dtype="bf16",
                                      state_bytes_per_element=12)
    # params 2 x 1,002; grads: the larger of the whole bf16 gradient (2,002) and the fp32 slice (2,004)
    assert states == {"params": 2004, "grads": 2004, "optimizer_states": 12 * 501}
    # stage 0: nothing partitioned, no padding; the whole fp32 sum (4,004) outgrows the bf16 gradients
    assert expert_model_state_bytes(bucket_numels=[1001], expert_data_size=2, stage=0, dtype="bf16",
                                    state_bytes_per_element=12) == {"params": 2002, "grads": 4004,
                                                                    "optimizer_states": 12_012}
    # over 4 ranks the slice (4 x 251) is smaller than the whole bf16 gradient
    assert expert_model_state_bytes(bucket_numels=[1001], expert_data_size=4, stage=3, dtype="bf16",
                                    state_bytes_per_element=12)["grads"] == 2002


def test_buckets_reduced_in_turn_free_their_whole_gradients_one_by_one():
    # fp32, 4 ranks: [400, 40] -> slices [100, 10]; held: 4·440 before, 4·40 + 4·100, 4·110 after
    states = expert_model_state_bytes(bucket_numels=[400, 40], expert_data_size=4, stage=1, dtype="fp32",
                                      state_bytes_per_element=8)
    assert states == {"params": 4 * 440, "grads": 4 * 440, "optimizer_states": 8 * 110}
    # bf16 at stage 0: [10, 1000] -> 2·1010, 2·1000 + 4·10, 4·1010: the last is the peak
    assert expert_model_state_bytes(bucket_numels=[10, 1000], expert_data_size=2, stage=0, dtype="bf16",
                                    state_bytes_per_element=12)["grads"] == 4040


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_partitioned_expert_gradients_are_reduce_scattered_in_fp32_and_gathered_in_the_parameter_dtype(stage):
    # 1,001 elements padded to 1,002 over 2 ranks: 4·1,002/2 and 2·1,002/2
    assert expert_gradient_bytes(bucket_numels=[1001], expert_data_size=2, stage=stage, param_bytes=2) == \
        {"all_reduce": 0, "all_gather": 1002, "reduce_scatter": 2004}


def test_whole_expert_gradients_are_all_reduced_at_stage_0_and_alone_send_nothing():
    # 2·4·1,000·3/4 over 4 ranks
    assert expert_gradient_bytes(bucket_numels=[1000], expert_data_size=4, stage=0, param_bytes=4) == \
        {"all_reduce": 6000, "all_gather": 0, "reduce_scatter": 0}
    assert expert_gradient_bytes(bucket_numels=[1000], expert_data_size=1, stage=1, param_bytes=4) == \
        {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
