"""1-bit Adam / LAMB by config and as classes: where they run (stages 0-2), what they refuse
and why, their K, their checkpoint codec, and their arithmetic on one process (where
there is nobody to exchange with: the variance freezes, the momentum is not compressed)."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.runtime.optim import OneBitAdam, OneBitLamb
from shardwise.runtime.optim.onebit import OneBitCodec
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.runtime.zero.workers import build_model, global_batch, model_loss


def problems(config: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 4, **config}, world_size=2)
    return caught.value.problems


def test_stage_3_is_refused_with_the_reason():
    block = {"type": "OneBitLamb", "params": {"freeze_step": 10}}
    assert problems({"optimizer": block, "zero_optimization": {"stage": 3}}) == [
        "optimizer.type 'OneBitLamb' runs at zero_optimization.stage 0, 1 or 2, not 3: after freeze_step each rank "
        "folds its whole local gradient into the whole model's momentum and keeps a whole error-feedback buffer "
        "(10 bytes per parameter with 16-bit gradients, more than stage 3 saves by partitioning the 2-byte "
        "parameters), and stage 3 frees each module's gathered parameters when its gradients are reduced, which "
        "that phase never does; use stage 2 (masters, variance and server error partitioned)"
    ]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_are_accepted(stage):
    config = load_config({"train_batch_size": 4, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10}},
                          "zero_optimization": {"stage": stage}}, world_size=2)
    assert config.zero_optimization.stage == stage


def test_hybrid_sharding_and_offload_are_refused():
    block = {"type": "OneBitAdam", "params": {"freeze_step": 10}}
    found = problems({"optimizer": block, "zero_optimization": {
        "stage": 2, "mics_shard_size": 1, "offload_optimizer": {"device": "cpu"}}})
    assert any("with zero_optimization.mics_shard_size is not supported" in line for line in found)
    assert any("with zero_optimization.offload_optimizer.device 'cpu' is not supported" in line for line in found)


def test_parameters_deepspeed_refuses_are_refused():
    found = problems({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True, "max_grad_norm": 1.0,
                                                                      "freeze_step": 0}}})
    assert any("amsgrad true: 1-bit Adam/LAMB have no AMSGrad variant" in line for line in found)
    assert any("max_grad_norm 1.0: DeepSpeed's 1-bit optimizers ignore it" in line for line in found)
    assert any(line.startswith("optimizer.params.freeze_step") for line in found)


def test_deepspeed_config_loads_with_its_transport_switches():
    config = load_config({"train_batch_size": 4, "optimizer": {"type": "onebitadam", "params": {
        "freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "nccl", "bias_correction": False}}},
        world_size=2)
    assert config.optimizer.type == "OneBitAdam" and config.optimizer.params["freeze_step"] == 23000


def _passed_at_stage_3(rank: int, world_size: int) -> None:
    model = build_model("gpt")
    shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
                         optimizer=OneBitAdam(model.parameters(), freeze_step=2))


def test_a_passed_optimizer_is_refused_at_stage_3():
    with pytest.raises(DistributedTestError, match="OneBitAdam runs at zero_optimization.stage 0, 1 or 2, not 3"):
        run_distributed(_passed_at_stage_3, 2)


def test_k_counts_the_worker_error_buffer():
    assert optimizer_spec("OneBitAdam").state_bytes_per_param({}, "bf16") == 16  # master, m, v, worker error
    assert optimizer_spec("OneBitLamb").state_bytes_per_param({}, "fp32") == 16  # m, v, fresh v, worker error


def test_codec_keeps_per_parameter_scalars_through_resharding():
    state = {"step": torch.tensor(7.0), "exp_avg": torch.arange(4.0), "exp_avg_sq": torch.ones(4),
             "exp_avg_sq_fresh": torch.full((4,), 2.0), "lamb_coeff_freeze": 0.25, "last_factor": 1.1}
    codec = OneBitCodec()
    elements, scalars = codec.encode(state, 4)
    assert set(elements) == {"exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "lamb_coeff_freeze", "last_factor"}
    piece = codec.decode({key: value[1:3] for key, value in elements.items()}, scalars)  # another rank's range
    assert piece["lamb_coeff_freeze"] == 0.25 and piece["last_factor"] == pytest.approx(1.1)
    assert torch.equal(piece["exp_avg"], torch.tensor([1.0, 2.0])) and piece["step"].item() == 7
    assert codec.state_bytes(state, 4) == 3 * 4 * 4


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_one_process_freezes_the_variance_and_keeps_the_momentum_exact(cls):
    """Without ranks the compression has nothing to do: after freeze_step the variance
    stays as it was and the momentum is Adam's, w <- w − lr · m / (√v + eps) (1-bit Adam;
    the native kernel's square root is correctly rounded, torch's vectorised one up to an
    ulp off, so the step to 1e-6 of itself)."""
    torch.manual_seed(0)
    model = build_model("gpt")
    optimizer = cls(model.parameters(), lr=1e-2, freeze_step=2, bias_correction=False)
    frozen = None
    for step in range(4):
        x, y = global_batch(step, 2)
        model_loss(model, "gpt", x, y).backward()
        before = {p: p.detach().clone() for p in model.parameters()}
        momentum = {p: optimizer.state[p]["exp_avg"].clone() for p in model.parameters() if optimizer.state[p]}
        optimizer.step()
        if step == 1:
            frozen = {p: optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()}
        if step >= 2:
            for p in model.parameters():
                state = optimizer.state[p]
                assert torch.equal(state["exp_avg_sq"], frozen[p])
                assert torch.allclose(state["exp_avg"], 0.9 * momentum[p] + 0.1 * p.grad, rtol=1e-6, atol=1e-9)
                if cls is OneBitAdam:
                    expected = before[p].add(state["exp_avg"] / (state["exp_avg_sq"].sqrt() + 1e-8), alpha=-1e-2)
                    allowed = 1e-6 * (expected.abs() + (expected - before[p]).abs()) + 1e-8
                    assert ((p - expected).abs() <= allowed).all()
        optimizer.zero_grad()


def test_constructor_checks():
    params = [torch.nn.Parameter(torch.zeros(8))]
    with pytest.raises(ValueError, match="freeze_step must be >= 1"):
        OneBitAdam(params, freeze_step=0)
    with pytest.raises(ValueError, match="comm_backend_name 'tcp'"):
        OneBitAdam(params, comm_backend_name="tcp")
    with pytest.raises(ValueError, match="need 0 < factor_min <= factor_max"):
        OneBitLamb(params, factor_min=2.0, factor_max=1.0)


@pytest.mark.parametrize("type_name", ["Lamb", "OneBitAdam", "OneBitLamb"])
def test_config_bias_correction_reaches_the_optimizer(type_name):
    """DeepSpeed's `bias_correction` is these optimizers' own argument (for Adam it picks
    the class), so a config's false must arrive."""
    params = [torch.nn.Parameter(torch.zeros(8))]
    built = optimizer_spec(type_name).build([{"params": params}], {"bias_correction": False, "betas": [0.9, 0.99]})
    assert built.defaults["bias_correction"] is False and built.defaults["betas"] == (0.9, 0.99)


def test_zero_one_adam_config_loads_and_runs_at_stage_0_only():
    """DeepSpeed's 0/1 Adam tutorial block loads (case-insensitive type, its transport
    switches, bias_correction); ZeRO is refused with DeepSpeed's reason."""
    block = {"type": "zerooneadam", "params": {
        "lr": 1e-3, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 1000,
        "var_update_scaler": 16, "local_step_scaler": 1000, "local_step_clipper": 16, "cuda_aware": False,
        "comm_backend_name": "nccl"}}
    config = load_config({"train_batch_size": 4, "optimizer": block}, world_size=2)
    assert config.optimizer.type == "ZeroOneAdam" and config.optimizer.params["local_step_scaler"] == 1000
    for stage in (1, 2, 3):
        assert problems({"optimizer": block, "zero_optimization": {"stage": stage}}) == [
            f"optimizer.type 'ZeroOneAdam' runs at zero_optimization.stage 0 only, not {stage}, as in DeepSpeed "
            "(\"0/1 Adam is not compatible with ZeRO\"): between synchronisations every rank takes whole local "
            "steps with the whole momentum, variance and accumulated update; use stage 0, or OneBitAdam at "
            "stages 1-2"]
    found = problems({"optimizer": {"type": "ZeroOneAdam", "params": {
        "eps_inside_sqrt": True, "var_freeze_step": 0, "local_step_clipper": 0}}})
    assert any("eps_inside_sqrt true: DeepSpeed's ZeroOneAdam accepts it and never applies it" in line
               for line in found)
    assert any(line.startswith("optimizer.params.var_freeze_step") for line in found)
    assert any(line.startswith("optimizer.params.local_step_clipper") for line in found)
