"""DeepSpeed's `deepspeed.utils.safe_*` helpers (issue 34): a parameter's fp32 master,
reduced gradient and optimizer state, whole or as this rank's fragment, at ZeRO stages
0-3, equal to what torch alone computes on the same global batch (fp32 < 1e-5)."""

import pytest
import torch

from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.api import fragment_workers

FP32 = 1e-5


def close(actual, expected):
    error = ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()
    assert error < FP32, f"relative error {error:.2e}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_helpers_read_and_write_the_training_state(stage):
    want = fragment_workers.reference()
    reports = run_distributed(fragment_workers.helpers, 2, stage)
    for report in reports:
        assert report["grads"]["0.bias"] is None and report["moments"]["0.bias"] is None  # frozen
        assert report["update_saw_every_param"]
        for name, grad in want["grads"].items():
            close(report["grads"][name], grad)
            close(report["doubled_grads"][name], 2 * grad)
            close(report["moments"][name], want["moments"][name])
            close(report["weights"][name], want["weights"][name])
        close(report["output_after_edit"], report["expected_after_edit"])
        assert torch.equal(report["moment_after_edit"], torch.tensor([0.5, 0.5, 0.5]))
    for name, grad in want["grads"].items():  # the ranks' fragments make up the whole
        pieces = [report["local_grads"][name] for report in reports]
        masters = [report["local_masters"][name] for report in reports]
        if stage == 0:  # every rank owns every element
            pieces, masters = pieces[:1], masters[:1]
        close(torch.cat(pieces), grad.reshape(-1))
        close(torch.cat(masters), reports[0]["masters_before"][name].reshape(-1))
