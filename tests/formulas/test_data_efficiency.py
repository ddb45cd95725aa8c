"""Random-LTD's numbers (formulas/data_efficiency.py) by hand; DeepSpeed's own scheduler
gives the same at every step in tests/runtime/data/test_token_schedule.py."""

from shardwise.formulas.data_efficiency import random_ltd_kept_tokens, random_ltd_layer_tokens

SCHEDULE = dict(min_value=128, max_value=2048, require_steps=100, seq_per_step=16)


def test_kept_tokens_rise_linearly_in_steps_of_seq_per_step_to_max():
    # step 1: floor(1/100 * 1920 + 128) = 147 -> 144; step 99: floor(2028.8) = 2028 -> 2016
    assert [random_ltd_kept_tokens(step, **SCHEDULE) for step in (0, 1, 50, 99, 100, 500)] == [
        128, 144, 1088, 2016, 2048, 2048]
    assert random_ltd_kept_tokens(1, min_value=10, max_value=100, require_steps=7, seq_per_step=8) == 16  # 22 -> 16
    assert random_ltd_kept_tokens(0, min_value=10, max_value=100, require_steps=7, seq_per_step=8) == 8  # 10 -> 8


def test_layer_tokens_count_kept_tokens_in_dropping_layers_and_all_in_the_others():
    assert random_ltd_layer_tokens(512, max_value=2048, layers=24, dropping_layers=22, global_batch=8) == (
        8 * (512 * 22 + 2048 * 2))
    assert random_ltd_layer_tokens(2048, max_value=2048, layers=24, dropping_layers=22, global_batch=8) == 8 * 2048 * 24
