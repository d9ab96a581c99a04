import numpy as np
import pytest

from jspec.layers.batch import bucket
from jspec.worker.inputs import SeqChunk, build_forward_batch


def test_bucket():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert bucket(3, minimum=8) == 8


def test_ragged_batch_layout():
    S = 4
    chunks = [SeqChunk([5, 6, 7], 0, [3]), SeqChunk([9], 5, [1, 2])]
    batch, mode = build_forward_batch(chunks, page_size=S, num_pages=8)
    assert not mode.decode_only
    assert list(batch.query_start) == [0, 3, 4]  # two sequences: B = 2, no padding slot
    assert list(batch.seq_lens[:2]) == [3, 6]
    np.testing.assert_array_equal(batch.tokens[:4], [5, 6, 7, 9])
    np.testing.assert_array_equal(batch.positions[:4], [0, 1, 2, 5])
    # token at position 5 of seq 1 lives on its second page (2), offset 1
    np.testing.assert_array_equal(batch.slots[:4], [12, 13, 14, 2 * S + 1])
    assert (batch.slots[4:] == 8 * S).all()  # padding rows write nowhere
    np.testing.assert_array_equal(batch.logits_indices[:2], [2, 3])


def test_decode_batch_has_one_row_per_slot():
    chunks = [SeqChunk([1], 7, [1, 2]), SeqChunk([2], 0, [3]), SeqChunk([3], 3, [4])]
    batch, mode = build_forward_batch(chunks, page_size=4, num_pages=8)
    assert mode.decode_only and mode.max_q_len == 1
    assert batch.tokens.shape == (4,) and batch.seq_lens.shape == (4,)
    assert batch.seq_lens[3] == 0 and batch.query_start[4] == 3


def test_short_page_table_is_an_error():
    with pytest.raises(ValueError, match="needs 2 pages"):
        build_forward_batch([SeqChunk([1, 2], 3, [1])], page_size=4, num_pages=8)
