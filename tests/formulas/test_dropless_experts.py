"""The dropless exchange's bytes by hand (the engine's count is compared with it in
tests/models/hf/test_experts.py)."""

import pytest

from shardwise.formulas.communication import dropless_exchange_bytes

ROUTED = [[3, 1, 2, 0],  # member 0 holds experts 0, 1
          [0, 4, 1, 1]]  # member 1 holds experts 2, 3


def test_a_member_sends_its_counts_the_rows_for_others_and_the_outputs_of_the_rows_it_received():
    # member 0: counts 8 B x 2 experts x 1 other; rows out 2 (for experts 2, 3), rows in 4 (from member 1)
    assert dropless_exchange_bytes(ROUTED, member=0, hidden_size=32, bytes_per_element=4) == 16 + 2 * 6 * 32 * 4
    assert dropless_exchange_bytes(ROUTED, member=0, hidden_size=32, bytes_per_element=4, backward=False) == \
        16 + 6 * 32 * 4
    # member 1: rows out 4 (for experts 0, 1), rows in 2 (from member 0)
    assert dropless_exchange_bytes(ROUTED, member=1, hidden_size=32, bytes_per_element=2) == 16 + 2 * 6 * 32 * 2


def test_rows_kept_by_their_own_member_send_nothing():
    assert dropless_exchange_bytes([[5, 0], [0, 7]], member=0, hidden_size=8, bytes_per_element=4) == 8


def test_experts_that_do_not_split_over_the_group_are_refused():
    with pytest.raises(ValueError, match="3 experts do not split over 2 ranks"):
        dropless_exchange_bytes([[1, 1, 1], [1, 1, 1]], member=0, hidden_size=8, bytes_per_element=4)
