"""Block quantization (C28): codes and scales by hand, the error bound of a block, frames
of the size the formulas count, and the same bits for a row whatever rows it travels with."""

import pytest
import torch

from shardwise.formulas.communication import quantized_frame_bytes
from shardwise.runtime.distributed.quantized import dequantize, frame_bytes, quantize, sum_rows


def test_int4_codes_by_hand():
    row = torch.tensor([[7.0, -3.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, -2.0]])
    frame = quantize(row, block=8, bits=4)
    # block 1: scale 7/7 = 1, codes 7, -4 (round half to even), 0, 1 stored + 8, two per byte, low first
    assert frame[0, 0].item() == (7 + 8) | ((-4 + 8) << 4)
    assert frame[0, 1].item() == (0 + 8) | ((1 + 8) << 4)
    # 10 elements: codes for 16 (8 bytes), then block scales 1.0 and 2/7
    assert frame.shape == (1, 8 + 2 * 4)
    assert frame[0, 8:].view(torch.float32).tolist() == [1.0, pytest.approx(2 / 7)]
    values = dequantize(frame, numel=10, block=8, bits=4)
    assert values.tolist() == [[7.0, -4.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, pytest.approx(2.0), pytest.approx(-2.0)]]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("numel", "block"), [(1000, 256), (37, 16), (8, 2048), (4096, 2048)])
def test_each_element_is_within_half_a_step_of_its_block(bits, numel, block):
    rows = torch.randn(3, numel, generator=torch.Generator().manual_seed(numel + bits)) * torch.tensor([[1.0], [1e-3],
                                                                                                        [50.0]])
    frames = quantize(rows, block=block, bits=bits)
    assert frames.shape == (3, frame_bytes(numel, block=block, bits=bits))
    assert frames.shape[1] == quantized_frame_bytes(numel, block=block, bits=bits)  # the formulas' count
    values = dequantize(frames, numel=numel, block=block, bits=bits)
    blocks = -(-numel // block)
    padded = torch.zeros(3, blocks * block)
    padded[:, :numel] = rows
    step = padded.view(3, blocks, block).abs().amax(dim=2) / (2 ** (bits - 1) - 1)
    error = torch.zeros(3, blocks * block)
    error[:, :numel] = (values - rows).abs()
    assert (error.view(3, blocks, block) <= step.unsqueeze(2) / 2 * (1 + 1e-6)).all()


def test_a_row_quantizes_to_the_same_bits_alone_or_with_others():
    rows = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    together = quantize(rows, block=64, bits=4)
    for index in range(4):
        assert quantize(rows[index:index + 1], block=64, bits=4)[0].equal(together[index])
    zeros = dequantize(quantize(torch.zeros(1, 20), block=8, bits=8), numel=20, block=8, bits=8)
    assert zeros.equal(torch.zeros(1, 20))  # a zero block has scale 0 and stays exact


def test_rows_are_summed_in_one_order():
    rows = torch.tensor([[1e8, 1.0], [-1e8, 1.0], [1.0, 1.0]])
    assert sum_rows(rows).tolist() == [1.0, 3.0]


def test_other_widths_are_refused():
    with pytest.raises(ValueError, match="int8 or int4 codes, not 2 bits"):
        quantize(torch.zeros(1, 8), block=8, bits=2)
