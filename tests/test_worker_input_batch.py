"""The runner's persistent batch: one block-table row per request, written only where a step appends blocks."""
from __future__ import annotations

import numpy as np

from engine.worker.input_batch import InputBatch


def test_a_row_holds_the_table_and_takes_only_appended_blocks():
    batch = InputBatch(num_rows=2, num_cols=4)
    row = batch.add_request()
    batch.append_blocks(row, [7, 3])
    batch.block_table[row, 0] = 99          # a block already written is not written again
    batch.append_blocks(row, [7, 3, 5])
    assert batch.block_table[row, :3].tolist() == [99, 3, 5] and batch.num_blocks[row] == 3


def test_a_preempted_request_is_rewritten_when_it_runs_again():
    batch = InputBatch(num_rows=2, num_cols=4)
    row = batch.add_request()
    batch.append_blocks(row, [1, 2, 3])
    batch.reset_blocks(row)                 # swapped out or recomputed: new blocks when it resumes
    batch.append_blocks(row, [8, 9])
    assert batch.block_table[row, :2].tolist() == [8, 9] and batch.num_blocks[row] == 2


def test_rows_are_reused_and_the_arrays_grow_keeping_their_contents():
    batch = InputBatch(num_rows=2, num_cols=2)
    a, b = batch.add_request(), batch.add_request()
    batch.append_blocks(a, [4, 5])
    c = batch.add_request()                 # a third request: twice the rows
    assert len({a, b, c}) == 3 and batch.block_table.shape[0] == 4
    batch.append_blocks(a, [4, 5, 6, 7, 8])  # a longer table: twice the columns (at least)
    assert batch.block_table[a, :5].tolist() == [4, 5, 6, 7, 8] and batch.block_table.shape[1] >= 5
    batch.remove_request(b)
    assert batch.add_request() == b and batch.num_blocks[b] == 0
    assert batch.block_table.dtype == np.int32
