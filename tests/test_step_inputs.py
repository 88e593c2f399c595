"""The packed step layout (runner/step_inputs.py): what `pack` lays out on the host, `unpack` reads back, padded."""

import numpy as np

from jaxserve.core.batch import RaggedBatch
from jaxserve.runner.step_inputs import StepLayout


def test_a_batch_of_a_decode_and_a_chunk_round_trips_through_the_packed_array():
    layout = StepLayout(page_size=4, max_num_seqs=3, pages_per_seq=5, max_logits_rows=6)
    # one decode at position 6 (pages 2, 7), one 3-token chunk at positions 0-2 (page 4)
    batch = RaggedBatch(requests=[object(), object()], num_decodes=1,
                        token_ids=np.array([11, 21, 22, 23], np.int32), positions=np.array([6, 0, 1, 2], np.int32),
                        cu_q_lens=np.array([0, 1, 4], np.int32), kv_lens=np.array([7, 3], np.int32),
                        page_table=np.array([[2, 7], [4, 0]], np.int32),
                        slot_mapping=np.array([30, 16, 17, 18], np.int32), logits_indices=np.array([0, 3], np.int32),
                        samples=np.array([True, True]))
    packed = layout.pack(batch, num_tokens=8)
    assert packed.dtype == np.int32 and packed.shape == (3 * 8 + 2 * 3 + 6 + 3 + 3 * 5,)

    tok, pos, meta, idx = layout.unpack(packed)
    np.testing.assert_array_equal(tok, [11, 21, 22, 23, 0, 0, 0, 0])
    np.testing.assert_array_equal(pos[:4], [6, 0, 1, 2])
    np.testing.assert_array_equal(meta.slot_mapping, [30, 16, 17, 18, 0, 1, 2, 3])  # padding: the trash page
    np.testing.assert_array_equal(idx, [0, 3, 0, 0, 0, 0])
    np.testing.assert_array_equal(meta.cu_q_lens, [0, 1, 4, 4])  # padded sequences hold no tokens
    np.testing.assert_array_equal(meta.kv_lens, [7, 3, 0])
    assert (int(meta.num_seqs), int(meta.num_decodes)) == (2, 1)
    np.testing.assert_array_equal(meta.page_table, [[2, 7, 0, 0, 0], [4, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
