"""`shardwise train` refuses bad flags and configs before starting any process."""

import json

import pytest

from shardwise.tools.cli.main import build_parser


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    args = build_parser().parse_args(["train", *argv])
    status = args.handler(args)
    return status, capsys.readouterr().err


def test_no_arguments_select_the_main_job():
    args = build_parser().parse_args(["train"])
    assert (args.model_size, args.stage, args.steps, args.nproc, args.bf16) == ("10m", None, None, None, False)
    assert args.out_dir == "runs" and not args.compare_stages and not args.profile


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--compare-stages", "--stage", "2"], "--compare-stages runs every stage; drop --stage"),
        (["--compare-stages", "--profile"], "--profile traces a training run"),
        (["--profile", "--steps", "2"], "--profile needs at least 3 steps"),
        (["--nproc", "3"], "train_batch_size 8 is not divisible by gradient_accumulation_steps 1 * world_size 3"),
        (["--compare-stages", "--save-every", "2"], "--save-every checkpoints a training run"),
        (["--ep-size", "2"], "--ep-size shape MoE blocks: give --moe-experts too"),
        (["--moe-experts", "4", "--ep-size", "3", "--nproc", "3"], "--ep-size 3 must divide --moe-experts 4"),
    ],
)
def test_contradictory_flags_are_refused(capsys, tmp_path, argv, message):
    status, err = run_cli(capsys, *argv, "--out-dir", str(tmp_path))
    assert status == 2
    assert message in err
    assert not any(path.name != ".cache" for path in tmp_path.iterdir())


def test_config_errors_name_the_key(capsys, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stgae": 2}}))
    status, err = run_cli(capsys, "--config", str(config), "--out-dir", str(tmp_path / "runs"))
    assert status == 2
    assert "stgae" in err and "stage" in err
    config.write_text("[1, 2]")
    status, err = run_cli(capsys, "--config", str(config), "--out-dir", str(tmp_path / "runs"))
    assert status == 2 and "must hold a JSON object" in err
    status, err = run_cli(capsys, "--config", str(tmp_path / "missing.json"))
    assert status == 2 and "cannot read --config" in err


def test_an_existing_run_is_not_overwritten(capsys, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.jsonl").write_text("{}\n")
    status, err = run_cli(capsys, "--out-dir", str(tmp_path), "--name", "taken")
    assert status == 2
    assert "already exists and is not empty" in err


@pytest.mark.parametrize("name", ["../x", "..", ".", "", "/tmp/elsewhere", "a/b", "runs/../../x"])
def test_a_name_that_leaves_the_out_dir_is_refused(capsys, tmp_path, name):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "--out-dir", str(tmp_path), "--name", name])
    assert exit_info.value.code == 2
    assert (
        f"argument --name: {name!r} would not be a directory inside --out-dir: give a plain name, "
        "without path separators, not '.' or '..'"
    ) in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_corpus_cache_is_not_a_run_name(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--name", ".cache"])
    assert "argument --name: '.cache' is the corpus cache inside --out-dir" in capsys.readouterr().err


def test_save_every_is_a_positive_step_count(capsys):
    assert build_parser().parse_args(["train", "--save-every", "25"]).save_every == 25
    assert build_parser().parse_args(["train"]).save_every is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--save-every", "0"])
    assert "argument --save-every: expected a positive integer, got '0'" in capsys.readouterr().err


def test_a_hugging_face_auto_config_is_filled_from_the_flags(tmp_path):
    from shardwise.frontends.deepspeed.config import load_config
    from shardwise.tools.train.cli import prepare_run

    template = "tests/frontends/deepspeed/config/corpus/stanford_alpaca__ds_config_zero3.json"
    args = build_parser().parse_args(["train", "--config", template, "--lr", "1e-3", "--steps", "20",
                                      "--nproc", "2", "--out-dir", str(tmp_path)])
    options, nproc = prepare_run(args)
    cfg = load_config(options.config, world_size=nproc, hidden_size=256)
    assert cfg.optimizer.params["lr"] == 1e-3 and cfg.scheduler.params["warmup_max_lr"] == 1e-3
    assert cfg.scheduler.params["total_num_steps"] == 20 and cfg.scheduler.params["warmup_num_steps"] == 2
    assert cfg.train_batch_size == 8 and cfg.zero_optimization.stage == 3


def test_moe_flags_make_the_gpt_an_moe_gpt(tmp_path):
    """`--moe-experts`, `--moe-top-k`, `--moe-every`, `--ep-size` reach the model's config
    (the expert step of parallelize then splits the experts: tests/models/gpt/test_gpt_moe.py)."""
    from shardwise.tools.train.cli import prepare_run
    from shardwise.tools.train.setup import model_config

    args = build_parser().parse_args(["train", "--moe-experts", "4", "--moe-top-k", "2", "--moe-every", "2",
                                      "--ep-size", "2", "--nproc", "2", "--out-dir", str(tmp_path)])
    options, _ = prepare_run(args)
    config = model_config(options)
    assert (config.moe_experts, config.moe_top_k, config.moe_every, config.moe_ep_size) == (4, 2, 2, 2)
    assert [config.is_moe_block(index) for index in range(4)] == [False, True, False, True]
