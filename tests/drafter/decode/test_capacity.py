"""drafter/decode/capacity.py: the one capacity rule, prompt + max_tokens + 2k + 2 positions."""
from __future__ import annotations

from specloop.drafter.decode.capacity import AUTO_K_MAX, draft_reserve, fits, positions_needed


def test_a_request_reserves_room_for_two_blocks_of_its_draft_length():
    assert draft_reserve(0) == 2 and draft_reserve(4) == 10
    assert draft_reserve(None) == 2 * AUTO_K_MAX + 2  # auto: the most a controller may choose
    assert draft_reserve(None, k_max=8) == 18


def test_positions_needed_and_fits_agree_at_the_edge():
    assert positions_needed(100, 50, 3) == 158
    assert fits(100, 50, 3, capacity=158) and not fits(100, 51, 3, capacity=158)
    assert fits(10, 10, None, capacity=30) and not fits(11, 10, None, capacity=30)
