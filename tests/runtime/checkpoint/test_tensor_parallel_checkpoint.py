"""Checkpoints of tensor-parallel shards (issue 10 item 6): pieces are stored in the whole
parameter's coordinates, so a run saved at TP=2 × DP=2 resumes at TP=1 and at another
data-parallel size with its optimizer state (SGD momentum, two param groups), a TP=1 run
resumes at TP=2, and `shardwise convert --hf` writes one folder of full weights. Each
interrupted run ends where the uninterrupted single-process run ends (fp32, < 1e-5).

GPT-2's fused c_attn is split per head (rank r holds its heads of q, of k and of v: three
ranges of the output dimension), which exercises pieces that are not one slice.
"""

import json

import pytest

from shardwise.runtime.checkpoint import convert_checkpoint
from shardwise.runtime.checkpoint.format import META
from shardwise.runtime.checkpoint.manifest import resolve_tag
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.checkpoint_workers import case_for, train_phase, train_reference

BEFORE, AFTER = 2, 2


def _assert_matches(results: list[dict], reference: dict, first_step: int) -> None:
    for rank, result in enumerate(results):
        for offset, got in enumerate(result["losses"]):
            want = reference["losses"][first_step + offset]
            assert abs(got - want) / abs(want) < 1e-5, f"rank {rank} step {first_step + offset}: {got} vs {want}"
        for name, want in reference["params"].items():
            error = ((result["params"][name] - want).norm() / want.norm()).item()
            assert error < 1e-5, f"rank {rank} {name}: relative error {error:.2e}"


def _save(model: str, stage: int, tensor: int, data: int, directory) -> None:
    case = case_for(model, stage, tensor, data)
    results = run_distributed(train_phase, tensor * data, case, tensor, str(directory), False, BEFORE)
    _assert_matches(results, train_reference(model, BEFORE), 0)


def _resume(model: str, stage: int, tensor: int, data: int, directory) -> None:
    case = case_for(model, stage, tensor, data)
    results = run_distributed(train_phase, tensor * data, case, tensor, str(directory), True, AFTER)
    _assert_matches(results, train_reference(model, BEFORE + AFTER), BEFORE)


@pytest.fixture(scope="module")
def gpt2_tp2_dp2(tmp_path_factory):
    """GPT-2 trained two steps at TP=2 × DP=2 (ZeRO-1), saved."""
    directory = tmp_path_factory.mktemp("tp2dp2")
    _save("gpt2", 1, 2, 2, directory)
    return directory


def test_pieces_are_whole_parameter_ranges_with_the_split_recorded(gpt2_tp2_dp2):
    meta = json.loads((resolve_tag(gpt2_tp2_dp2, None) / META).read_text())
    shapes = {entry["name"]: entry["shape"] for entry in meta["parameters"]}
    assert shapes["transformer.h.0.attn.c_attn.weight"] == [32, 96]  # whole, not the local [32, 48]
    split = meta["tensor_parallel"]["split"]
    assert meta["tensor_parallel"]["size"] == 2
    assert split["transformer.h.0.attn.c_attn.weight"] == {"dim": 1, "global_shape": [32, 96], "blocks": 3}
    assert split["transformer.h.0.attn.c_proj.weight"]["dim"] == 0  # Conv1D (in, out): row-parallel splits rows
    assert "transformer.ln_f.weight" not in split  # replicated
    records = [json.loads(path.read_text()) for path in sorted(resolve_tag(gpt2_tp2_dp2, None).glob("rank_*.json"))]
    c_attn = [piece for record in records for piece in record["pieces"]
              if piece["name"] == "transformer.h.0.attn.c_attn.weight"]
    # 2 tensor ranks x 32 rows x 3 ranges (q, k, v heads) = 192 runs, stored as a few strided pieces
    assert 2 <= len(c_attn) <= 8 and all(piece["stride"] == 32 and piece["run"] == 16 for piece in c_attn
                                         if "run" in piece)


def test_tp2_dp2_resumes_at_tp1_dp2(gpt2_tp2_dp2):
    _resume("gpt2", 2, 1, 2, gpt2_tp2_dp2)


def test_tp2_dp2_resumes_at_tp2_dp1_stage3(gpt2_tp2_dp2):
    _resume("gpt2", 3, 2, 1, gpt2_tp2_dp2)


def test_tp2_dp2_converts_to_one_hugging_face_folder(gpt2_tp2_dp2, tmp_path):
    from transformers import GPT2LMHeadModel

    convert_checkpoint(gpt2_tp2_dp2, tmp_path, hf=True)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    reference = train_reference("gpt2", BEFORE)["params"]
    for name, param in loaded.named_parameters():
        error = ((param.detach() - reference[name]).norm() / reference[name].norm()).item()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"


def test_tp1_dp2_resumes_at_tp2_on_the_tied_gpt(tmp_path):
    _save("gpt", 2, 1, 2, tmp_path)
    _resume("gpt", 1, 2, 1, tmp_path)


def test_tp1_single_process_resume_of_a_tp2_checkpoint(gpt2_tp2_dp2):
    _resume("gpt2", 0, 1, 1, gpt2_tp2_dp2)
