"""DeepSpeed's Python API (shardwise.frontends.deepspeed.api): initialize's arguments, the
engine's DeepSpeed methods, checkpoints, GatheredParameters, comm, and the optimizer
classes, each checked against what DeepSpeed does or against plain PyTorch."""

import argparse
import json
import os

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardwise.frontends.deepspeed.api.ops.lamb import FusedLamb
from shardwise.runtime.optim.lamb import Lamb
from shardwise.runtime.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.api import workers
from tests.frontends.deepspeed.deepspeed_side import deepspeed_json

FP32 = 1e-5


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_initialize_trains_like_plain_torch_with_deepspeed_arguments(stage, tmp_path):
    reports = run_distributed(workers.train_through_api, 2, stage, str(tmp_path))
    check_checkpoints_and_16bit_model(reports, stage, tmp_path)
    all_rows = []
    for rank, report in enumerate(reports):
        assert report["local_rank_arg"] == rank  # args.local_rank aligned to LOCAL_RANK, as DeepSpeed does
        # model_parameters' own groups and hyper-parameters, with the config's optimizer
        assert report["group_hyper"] == [(workers.LR, workers.DECAY), (workers.BIAS_LR, 0.0)]
        assert report["accessors"] == (8, 2, 2, 2, stage, False, False, rank, rank, 2)
        assert report["parallel_accessors"] == ((8, 2, 2), rank, 0, 0, None)
        assert report["passthrough"][:2] == ("the user's model", "the user's model with 65 parameters")
        assert report["passthrough"][2:] == (True, True)
        assert report["batch_sizes"] == [workers.MICRO] * 6
        assert report["applied"] == [False, True] * 3  # only accumulation boundaries update
        assert report["grad_norm"] > 0
        assert report["modes"] == (False, False)
        for name, weight in report["reference"].items():
            error = ((report["weights"][name] - weight).norm() / weight.norm()).item()
            assert error < FP32, f"rank {rank} {name}: relative error {error:.2e}"
        all_rows += report["rows"]
    assert sorted(all_rows) == list(range(workers.ROWS))  # each rank its own share of every sample


def check_checkpoints_and_16bit_model(reports, stage, tmp_path):
    """DeepSpeed's shapes: save returns True, load (path, client_state), (None, None) without `latest`."""
    for report in reports:
        assert report["saved"] is True
        assert report["latest_after_second"] == "first"  # save_latest=False left `latest` alone
        assert report["loaded_path"] == str(tmp_path / f"checkpoints_{stage}" / "first")
        assert report["client_state"] == {"epoch": 3}
        assert report["restored"]  # weights edited through GatheredParameters(modifier_rank=0) came back
        assert report["loaded_path_not_strict"] == report["loaded_path"]
        assert len(report["refusals"]) == 1  # custom_load_fn
        assert all("not supported" in message and "shardwise convert" in message for message in report["refusals"])
        assert report["missing"] == (None, None)
        assert report["sixteen_bit_written"] and report["sixteen_bit_equal"]
        assert report["comm"][:2] == (report["comm"][2], 2)
        assert report["comm"][3:] == (3.0, 17.0, [0.0, 1.0], True)


def test_passed_optimizer_and_scheduler_win_over_the_config():
    for rank, report in enumerate(run_distributed(workers.client_optimizer_wins, 2)):
        assert report["optimizer"] == "SGD" and report["scheduler"] == "StepLR"
        assert report["callable_got"] == 4  # the callable received the model's parameters
        assert report["lr_after_step"] == 0.25  # the client's StepLR stepped once by the engine
        assert report["loader"] is None
        assert report["env_local_rank"] == rank


def test_config_sources_are_checked_before_anything_starts():
    args = argparse.Namespace(deepspeed_config="a.json", local_rank=-1)
    with pytest.raises(ValueError, match="two configs"):
        deepspeed.initialize(args=args, model=nn.Linear(2, 2), config={"train_batch_size": 1})
    with pytest.raises(ValueError, match="needs a config"):
        deepspeed.initialize(model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="requires a model"):
        deepspeed.initialize(config={})
    with pytest.raises(ValueError, match="mpu"):
        deepspeed.initialize(model=nn.Linear(2, 2), config={}, mpu=object())
    both = argparse.Namespace(deepspeed_config="a.json", deepscale_config="b.json")
    with pytest.raises(ValueError, match="keep --deepspeed_config"):
        deepspeed.initialize(args=both, model=nn.Linear(2, 2))


def test_add_config_arguments_adds_deepspeeds_flags():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "ds.json", False, None)


def _train(optimizer_class, steps=4, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    optimizer = optimizer_class(model.parameters(), **kwargs)
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        optimizer.step()
    return torch.cat([param.detach().flatten() for param in model.parameters()])


@pytest.mark.parametrize("deepspeed_class, mode_argument", [(FusedAdam, "adam_w_mode"), (DeepSpeedCPUAdam, "adamw_mode")])
def test_deepspeed_adam_classes_are_torchs_adam_and_adamw(deepspeed_class, mode_argument):
    hyper = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)
    assert torch.allclose(_train(deepspeed_class, **hyper), _train(torch.optim.AdamW, **hyper), rtol=FP32, atol=1e-7)
    assert torch.allclose(_train(deepspeed_class, **hyper, **{mode_argument: False}),
                          _train(torch.optim.Adam, **hyper), rtol=FP32, atol=1e-7)
    with pytest.raises(ValueError, match="bias_correction"):
        deepspeed_class([nn.Parameter(torch.zeros(1))], bias_correction=False)


def test_fused_lamb_is_shardwise_lamb():
    hyper = dict(lr=0.01, weight_decay=0.01, max_coeff=5.0, min_coeff=0.1)
    assert torch.equal(_train(FusedLamb, **hyper), _train(Lamb, **hyper))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLamb([nn.Parameter(torch.zeros(1))], amsgrad=True)
    with pytest.raises(ValueError, match="gradient_clipping"):
        FusedLamb([nn.Parameter(torch.zeros(1))], max_grad_norm=1.0)


def test_lr_schedules_are_shardwises():
    from shardwise.frontends.deepspeed.api.runtime import lr_schedules

    assert (lr_schedules.WarmupLR, lr_schedules.WarmupDecayLR, lr_schedules.WarmupCosineLR) == (
        WarmupLR, WarmupDecayLR, WarmupCosineLR)


def test_cpu_accelerator_answers_as_deepspeeds_cpu_class(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CUDA accelerator answers with CUDA devices")
    monkeypatch.setenv("LOCAL_SIZE", "3")
    accelerator = deepspeed.get_accelerator()
    assert (accelerator.device_name(), accelerator.device_name(1), accelerator.current_device_name()) == ("cpu",) * 3
    assert accelerator.communication_backend_name() == "gloo"
    assert accelerator.device_count() == 3 and accelerator.is_available()
    accelerator.manual_seed_all(5)
    first = torch.rand(2)
    accelerator.manual_seed(5)
    assert torch.equal(first, torch.rand(2))


# Every public name of DeepSpeed 0.19.8's `DeepSpeedAccelerator` (deepspeed/accelerator/abstract_accelerator.py)
ACCELERATOR_NAMES = (
    "BFloat16Tensor ByteTensor DoubleTensor Event FloatTensor HalfTensor IntTensor LongTensor Stream available_memory "
    "build_extension capture_to_graph communication_backend_name create_graph create_op_builder current_device "
    "current_device_name current_stream default_generator default_stream device device_count device_name empty_cache "
    "export_envs get_compile_backend get_op_builder get_rng_state handles_memory_backpressure initial_seed "
    "is_available is_bf16_supported is_current_stream_capturing is_fp16_supported is_fp64_supported is_pinned "
    "is_synchronized_device is_triton_supported lazy_call manual_seed manual_seed_all max_memory_allocated "
    "max_memory_cached max_memory_reserved memory_allocated memory_cached memory_reserved memory_stats on_accelerator "
    "op_builder_dir pin_empty pin_empty_like pin_memory pin_memory_alignment prefer_triton_grouped_mm random range_pop "
    "range_push register_host_memory replay_graph reset_max_memory_allocated reset_max_memory_cached "
    "reset_peak_memory_stats resolves_data_dependency set_compile_backend set_device set_rng_state "
    "set_visible_devices_envs stream supported_dtypes supports_nvtx_domain synchronize total_memory unpin_memory "
    "unregister_host_memory use_host_timers visible_devices_envs").split()


def test_the_accelerator_answers_every_question_deepspeeds_does():
    accelerator = deepspeed.get_accelerator()
    assert [name for name in ACCELERATOR_NAMES if not hasattr(accelerator, name)] == []
    if os.environ.get("DEEPSPEED_PYTHON"):
        listed = deepspeed_json("import inspect, json\n"
                                "from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator\n"
                                "print(json.dumps(sorted(n for n, _ in inspect.getmembers(DeepSpeedAccelerator) "
                                "if not n.startswith('_'))))")
        assert listed == sorted(ACCELERATOR_NAMES)


# What DeepSpeed 0.19.8's CPU accelerator answers, each question as a line of Python over `a`
CPU_QUESTIONS = {
    "synchronized": "a.is_synchronized_device() and a.use_host_timers() and a.resolves_data_dependency()",
    "no streams": "(a.Stream, a.Event, a.current_stream(), a.default_stream(), a.create_graph())",
    "empty stream context": "type(a.stream(None).__enter__()).__name__",
    "float tensor type": "a.FloatTensor([1.5]).dtype == torch.float32 and a.LongTensor is torch.LongTensor",
    "generator": "a.default_generator(0) is torch.default_generator and a.random() is torch.random",
    "lazy call": "a.lazy_call(lambda: 7)",
    # the peak read after the current figure: the other order races the process's growth in between
    "memory in step": "(a.memory_allocated() > 2**20, (lambda now: a.max_memory_allocated() >= now)("
                      "a.memory_allocated()), a.memory_reserved() > 2**20, sorted(a.memory_stats()))",
    "host memory": "0 < a.available_memory() <= a.total_memory()",
    "triton": "a.is_triton_supported()",
    "envs": "(a.export_envs(), a.visible_devices_envs())",
    "set envs": "(lambda env: (a.set_visible_devices_envs(env, [0, 2]), env)[1])({})",
    "compile backend": "a.get_compile_backend()",
    "op builders": "(a.create_op_builder('CPUAdamBuilder').is_compatible(), "
                   "a.create_op_builder('NoSuchBuilder').is_compatible())",
    "fp64": "a.is_fp64_supported()",
}


def test_cpu_accelerator_answers_the_rest_as_deepspeeds_cpu_class():
    if torch.cuda.is_available():
        pytest.skip("the CUDA accelerator answers with CUDA objects")
    accelerator = deepspeed.get_accelerator()
    mine = {key: eval(question, {"torch": torch, "a": accelerator}) for key, question in CPU_QUESTIONS.items()}
    expected = {"synchronized": True, "no streams": (None,) * 5, "empty stream context": "NoneType",
                "float tensor type": True, "generator": True, "lazy call": 7,
                "memory in step": (True, True, True, ["allocated_bytes.all.current", "allocated_bytes.all.peak"]),
                "host memory": True, "triton": False, "envs": ([], ["CUDA_VISIBLE_DEVICES"]),
                "set envs": {"CUDA_VISIBLE_DEVICES": "0,2"}, "compile backend": "inductor",
                "op builders": (True, True), "fp64": True}
    assert mine == expected
    with pytest.raises(ValueError, match="not been implemented"):
        accelerator.create_op_builder("NoSuchBuilder").load()
    if os.environ.get("DEEPSPEED_PYTHON"):
        script = ("import json, torch\nfrom deepspeed.accelerator import get_accelerator\na = get_accelerator()\n"
                  f"questions = {CPU_QUESTIONS!r}\n"
                  "answers = {k: eval(q, {'torch': torch, 'a': a}) for k, q in questions.items()}\n"
                  "print(json.dumps(answers, default=repr))")
        theirs = deepspeed_json(script)
        assert theirs == json.loads(json.dumps(mine, default=repr))


ON_DEVICE = """
import json, torch
def answers(deepspeed):
    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        linear = torch.nn.Linear(4, 3)
        index, legacy = torch.zeros(2, dtype=torch.long), torch.Tensor(2, 3)
        explicit = torch.ones(2, device="cpu")
    with deepspeed.OnDevice(dtype=torch.float16, enabled=False):
        untouched = torch.nn.Linear(2, 2)
    after = torch.empty(1)
    return [str(t.device) + " " + str(t.dtype) for t in (linear.weight, linear.bias, index, legacy, explicit,
                                                         untouched.weight, after)]
"""


def test_on_device_builds_tensors_where_and_in_the_dtype_deepspeeds_does():
    namespace: dict = {}
    exec(ON_DEVICE, namespace)
    mine = namespace["answers"](deepspeed)
    assert mine == ["meta torch.float16", "meta torch.float16", "meta torch.int64", "meta torch.float16",
                    "cpu torch.float16", "cpu torch.float32", "cpu torch.float32"]
    if os.environ.get("DEEPSPEED_PYTHON"):
        assert deepspeed_json(ON_DEVICE + "import deepspeed\nprint(json.dumps(answers(deepspeed)))") == mine


def test_zero_init_builds_the_same_model_and_gathering_untrained_parameters_does_nothing():
    torch.manual_seed(1)
    expected = nn.Linear(3, 2).weight.detach().clone()
    torch.manual_seed(1)
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = nn.Linear(3, 2)
    assert torch.equal(model.weight, expected)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.weight.data.zero_()
    with deepspeed.zero.GatheredParameters(model.weight, enabled=False):
        pass
    assert model.weight.abs().sum() == 0  # not an engine's parameter: the block is plain code


def test_moe_param_groups_put_experts_in_groups_of_their_own():
    from shardwise.frontends.deepspeed.api.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    params = list(nn.Linear(2, 2).parameters())
    groups = split({"params": iter(params), "name": "parameters"})
    assert len(groups) == 1 and groups[0]["params"] == params and groups[0]["name"] == "parameters"
    experts = [nn.Parameter(torch.zeros(3)) for _ in range(3)]
    for expert in experts:
        expert.allreduce, expert.group_name = False, "ep_size_1"
    groups = split([{"params": params + experts, "name": "parameters", "weight_decay": 0.1}], max_group_size=6)
    assert [(g["name"], g.get("moe", False), len(g["params"]), g["weight_decay"]) for g in groups] == [
        ("parameters", False, 2, 0.1), ("ep_size_1", True, 2, 0.1), ("ep_size_1", True, 1, 0.1)]
