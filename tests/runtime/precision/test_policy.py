"""PrecisionPolicy's gradient accumulation dtype: fp32 or the parameters' own, and never
beside 16-bit masters (which take 16-bit gradients)."""

import pytest
import torch

from shardwise.runtime.precision.policy import PrecisionPolicy


def test_the_accumulation_dtype_is_the_parameters_unless_fp32_is_asked():
    assert PrecisionPolicy(torch.bfloat16).accumulation_dtype == torch.bfloat16
    assert PrecisionPolicy(torch.bfloat16, grad_accum_dtype=torch.float32).accumulation_dtype == torch.float32
    assert PrecisionPolicy(torch.float16, grad_accum_dtype=torch.float16).accumulation_dtype == torch.float16


def test_another_16_bit_dtype_is_refused():
    with pytest.raises(ValueError, match="must be fp32 or the parameters' own dtype"):
        PrecisionPolicy(torch.bfloat16, grad_accum_dtype=torch.float16)


def test_fp32_accumulation_beside_bf16_masters_is_refused():
    with pytest.raises(ValueError, match="16-bit masters take 16-bit gradients"):
        PrecisionPolicy(torch.bfloat16, master_dtype=torch.bfloat16, grad_accum_dtype=torch.float32)
