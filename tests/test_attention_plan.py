"""The Triton attention's launch plan (``runner/kernels/triton_extend.py``: ``plan``,
``splits_for``, ``launch_config``): host numbers in, key splits and a tile out. Pure Python, so
these run on the CPU; the kernel itself is tested on the GPU (tests/kernels/)."""

from __future__ import annotations

from dllm.runner.kernels.triton_extend import (
    MAX_PLAN_SPLITS,
    MAX_SPLITS,
    SMALL_GRID,
    WIDE_MIN_PROGRAMS,
    WIDE_TILE,
    default_config,
    launch_config,
    plan,
    splits_for,
)

H200 = 132  # SMs


def test_splits_for_fills_two_waves():
    assert splits_for(1, 8, H200) == MAX_SPLITS  # 8 programs: 264 / 8 = 33, capped
    assert splits_for(4, 8, H200) == 9  # 32 programs -> 288 >= 264
    assert splits_for(16, 8, H200) == 3
    assert splits_for(33, 8, H200) == 1  # 264 programs already
    assert splits_for(128, 8, H200) == 1
    assert splits_for(2, 4, num_sms=16) == 4
    assert splits_for(1, 8) == MAX_SPLITS  # the reference device's SMs
    for rows in range(1, 200):
        s = splits_for(rows, 8, H200)
        assert 1 <= s <= MAX_SPLITS
        # the fewest splits that fill two waves: one fewer would not
        assert s == MAX_SPLITS or rows * 8 * s >= 2 * H200
        assert s == 1 or rows * 8 * (s - 1) < 2 * H200


def test_launch_config():
    """The 16-row query tile only for a split launch under one wave at the default tile."""
    # one row: LLaDA-8B (32 KV heads, 32 rows), Dream-7B (4, 224), LLaDA2-mini (4, 128)
    assert launch_config(1, 32, 32, 128, 4, H200) == SMALL_GRID
    assert launch_config(1, 4, 224, 128, 4, H200) == SMALL_GRID
    assert launch_config(1, 4, 128, 128, 4, H200) == SMALL_GRID
    assert launch_config(2, 32, 32, 128, 4, H200) is None  # 256 programs already
    assert launch_config(1, 4, 128, 128, 1, H200) is None  # no split: the default tile
    assert launch_config(1, 8, 16, 128, 4, H200) is None  # the default tile is 16 rows
    assert launch_config(1, 4, 128, 256, 4, H200) is None  # head_dim 256: its own tile
    assert launch_config(1, 4, 128, 128, 4, 16) is None  # a GPU of 16 SMs: a wave


def test_plan_wide_tiles():
    """Query tiles of >= 64 rows whose default grid is under one wave: the wide tile."""
    assert plan(1, 4, 384 * 7, 128, H200) == (1, WIDE_TILE)  # Dream-7B's canvas
    assert plan(1, 32, 384, 128, H200) == (1, WIDE_TILE)  # LLaDA-8B's canvas
    assert plan(1, 32, 64, 128, H200) == (1, WIDE_TILE)  # a 64-token window: 32 programs
    assert plan(1, 4, 96 * 7, 128, H200) == (1, WIDE_TILE)  # Dream's 96-token window
    assert plan(32, 4, 128, 128, H200) == (1, WIDE_TILE)  # LLaDA2-mini: 128 programs of 128
    assert plan(3, 4, 128, 128, H200) == (1, WIDE_TILE)  # 24 programs of 64 rows
    assert plan(1, 4, 384 * 7, 64, H200) == (1, WIDE_TILE)  # head_dim 64 too


def test_plan_edges():
    # at least 64 query rows
    assert plan(1, 32, 63, 128, H200) != (1, WIDE_TILE)
    # at least WIDE_MIN_PROGRAMS programs of 64 rows: 6 chunks × 4 KV heads, not 5
    assert WIDE_MIN_PROGRAMS == 24
    assert plan(1, 4, 6 * 64, 128, H200) == (1, WIDE_TILE)
    assert plan(1, 4, 5 * 64, 128, H200)[1] != WIDE_TILE
    assert plan(2, 4, 128, 128, H200) == (4, SMALL_GRID)  # 16 programs of 64 rows
    # one to two waves of the default tile: that tile, unsplit (33 rows of LLaDA2-mini fill
    # one wave; at 64 rows 27.9 µs against 33.2 wide and 47.1 with 2 splits on the H200)
    assert plan(33, 4, 128, 128, H200) == (1, None)
    assert plan(64, 4, 128, 128, H200) == (1, None)
    assert plan(32, 4, 224, 128, H200) == (1, None)  # Dream's window at batch 32: 256
    assert plan(128, 4, 128, 128, H200) == (1, None)  # two waves and more: unsplit anyway
    assert plan(128, 4, 224, 128, H200) == (1, None)
    assert plan(1, 4, 384 * 7, 256, H200) == (MAX_PLAN_SPLITS, None)  # head_dim 256
    # on a GPU of fewer SMs the same shape fills a wave sooner
    assert plan(32, 4, 128, 128, 100) == (1, None)


def test_plan_split_tiles():
    """Under 64 query rows or 24 wide programs: the split plan, counting the default tile's M
    chunks."""
    assert plan(1, 4, 224, 128, H200) == (4, SMALL_GRID)  # Dream's 32-token window
    assert plan(1, 32, 32, 128, H200) == (4, SMALL_GRID)  # LLaDA-8B's 32-token window
    assert plan(1, 4, 128, 128, H200) == (4, SMALL_GRID)  # LLaDA2-mini at batch 1
    assert plan(1, 8, 16, 128, H200) == (MAX_PLAN_SPLITS, None)  # SDAR-8B at batch 1
    assert plan(32, 8, 16, 128, H200) == (2, None)  # 256 programs: two waves of splits
    assert plan(8, 32, 32, 128, H200) == (2, None)  # LLaDA-8B's window at batch 8
    assert plan(128, 8, 16, 128, H200) == (1, None)
    assert plan(1, 8, 4, 128, H200) == (MAX_PLAN_SPLITS, None)  # decode, batch 1
    assert plan(64, 8, 4, 128, H200) == (1, None)  # decode, batch 64


def test_plan_below_64_rows_splits_to_two_waves():
    """Below 64 query rows never the wide tile, and the fewest splits (up to the cap) that
    fill two waves of the default tile's programs."""
    for hkv in (1, 2, 4, 8, 16, 32):
        for m in (1, 4, 8, 16, 32, 63):
            chunks = -(-m // default_config(m, 128)["BLOCK_M"])
            for rows in range(1, 257):
                splits, cfg = plan(rows, hkv, m, 128, H200)
                assert cfg != WIDE_TILE
                programs = rows * hkv * chunks
                assert splits == MAX_PLAN_SPLITS or programs * splits >= 2 * H200
                assert splits == 1 or programs * (splits - 1) < 2 * H200
