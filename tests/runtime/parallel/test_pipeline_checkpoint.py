"""Checkpoints reshard across pipeline sizes: saved at pp=2 and resumed at pp=1, and the
reverse, training continues exactly as the uninterrupted single-process reference (model
and AdamW state, counters), since checkpoints are keyed by parameter name and every
stage's parameters keep their original names."""

import dataclasses

import pytest

from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.pipeline_workers import PipeCase, checkpoint_run, train_reference
from tests.runtime.zero.workers import relative_error


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_another_pipeline_size(tmp_path, before, after):
    case = PipeCase(steps=3)
    first = run_distributed(checkpoint_run, before, dataclasses.replace(case, pipeline=before), str(tmp_path),
                            range(0, 2), False)
    second = run_distributed(checkpoint_run, after, dataclasses.replace(case, pipeline=after), str(tmp_path),
                             range(2, 3), True)
    reference = train_reference(case, 1)
    for result in first:
        for got, want in zip(result["losses"], reference["losses"][:2]):
            assert abs(got - want) / want < 1e-5
    params = {}
    for result in second:
        assert result["global_steps"] == 3
        assert abs(result["losses"][0] - reference["losses"][2]) / reference["losses"][2] < 1e-5
        params.update(result["params"])
    assert set(params) == set(reference["params"])
    for name, want in reference["params"].items():
        assert relative_error(params[name], want) < 1e-5, name


def test_a_pp2_llama_checkpoint_converts_to_a_hugging_face_folder(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from shardwise.runtime.checkpoint import convert_checkpoint

    case = PipeCase(model="llama", steps=1)
    results = run_distributed(checkpoint_run, 2, case, str(tmp_path / "ckpt"), range(0, 1), False)
    convert_checkpoint(tmp_path / "ckpt", tmp_path / "hf", hf=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = {}
    for result in results:
        trained.update(result["params"])
    loaded = dict(model.named_parameters())
    assert set(loaded) == set(trained)
    for name, value in trained.items():
        assert torch.equal(loaded[name].detach(), value), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
