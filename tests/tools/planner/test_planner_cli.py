"""`shardwise estimate` run in-process: the printed table and its error handling."""

import argparse
from pathlib import Path

import pytest
from transformers import LlamaConfig

from shardwise.tools.planner import cli


def run_estimate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="shardwise")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate", *argv])
    code = args.handler(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table_rows(output: str) -> dict[tuple[str, str], list[str]]:
    """Body rows of the options table keyed by (stage, offload)."""
    rows = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) == 7 and cells[0].isdigit():
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def test_paper_table_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_estimate(["--params", "7.5e9", "--gpus", "64"], capsys)
    assert code == 0
    rows = table_rows(out)
    assert [rows[(stage, "none")][0] for stage in "0123"] == ["120 GB", "31.4 GB", "16.6 GB", "1.9 GB"]
    assert rows[("0", "none")][-1] == "no (GPU)"
    assert rows[("1", "none")][-1] == "yes ◀"
    # stage 2 + CPU optimizer: GPU keeps 2Ψ; the node's 8 ranks keep 8 × 16Ψ/64 on the host
    assert rows[("2", "optimizer→cpu")][:4] == ["15.0 GB", "0", "15.0 GB", "0"]
    assert rows[("3", "optimizer→nvme")][-1] == "no (NVMe)"
    assert len(rows) == 10
    assert "Recommended: stage 1, no recomputation." in out


def test_fp32_table_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_estimate(["--params", "7.5e9", "--gpus", "64", "--dtype", "fp32"], capsys)
    rows = table_rows(out)
    assert [rows[(stage, "none")][0] for stage in "0123"] == ["120 GB", "60.9 GB", "31.4 GB", "1.9 GB"]
    assert "K = 8 bytes/parameter" in out


def test_hf_config_and_activation_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=1000).to_json_file(tmp_path / "config.json")
    code, out, _ = run_estimate(["--hf-config", str(tmp_path / "config.json"), "--seq-len", "128"], capsys)
    assert code == 0
    assert "Activations per GPU" in out
    assert "L·s·b·h·(34 + 5·a·s/h) + 4·s·b·V = 2 × 128 × 1 × 64 × (34 + 5 × 4 × 128 / 64)" in out
    assert table_rows(out)[("0", "none")][-1] == "yes ◀"


def test_llama_70b_on_eight_gpus_reports_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_estimate(["--preset", "llama-70b", "--gpus", "8"], capsys)
    assert code == 0
    rows = table_rows(out)
    assert rows[("3", "optimizer→cpu")][2] == "1104 GB"
    assert all("◀" not in cells[-1] for cells in rows.values())
    assert "Nothing fits" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf-config", "/nonexistent/config.json"], "no Hugging Face config at /nonexistent/config.json"),
        (["--preset", "gpt2", "--layers", "4"], "go with --params"),
        (["--params", "1e9", "--gpus", "0"], "GPU counts must be positive"),
    ],
)
def test_bad_input_exits_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_estimate(argv, capsys)
    assert code == 2
    assert message in err
    assert out == ""


def test_a_model_source_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_estimate(["--gpus", "8"], capsys)
    assert "one of the arguments --params --hf-config --preset is required" in capsys.readouterr().err


def test_reachable_from_the_shardwise_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.tools.cli.main import main

    assert main(["estimate", "--params", "7.5e9", "--gpus", "64"]) == 0
    assert table_rows(capsys.readouterr().out)[("3", "none")][0] == "1.9 GB"


def test_lora_counts_frozen_weights_at_two_bytes_and_partitions_them_at_stage_3(capsys) -> None:
    """Llama-2 70B with 2e8 trained (LoRA) parameters on 8 GPUs: model states are
    16 bytes × Ψ_t (/N by stage) + 2 bytes × Ψ_f (whole, or /N at stage 3)."""
    code, out, _ = run_estimate(["--preset", "llama-70b", "--gpus", "8", "--trainable-params", "2e8"], capsys)
    assert code == 0
    frozen = 68_976_648_192 - 200_000_000
    rows = table_rows(out)
    gb = lambda n: f"{n / 1e9:.3g} GB"  # noqa: E731
    assert rows[("0", "none")][0] == gb(16 * 200_000_000 + 2 * frozen)
    assert rows[("3", "none")][0] == gb(16 * 200_000_000 / 8 + 2 * frozen / 8)
    assert "frozen params 2Ψ_f/N" in out and "Ψ_t = 200,000,000 trained" in out


@pytest.mark.parametrize("count", ["0", "1.5", "1e12"])
def test_trainable_params_out_of_range_is_an_error(count, capsys) -> None:
    code, _, err = run_estimate(["--preset", "gpt2", "--trainable-params", count], capsys)
    assert code == 2 and "--trainable-params" in err


def test_step_time_table_is_printed_fastest_first(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_estimate(["--preset", "gpt2", "--gpus", "16", "--micro-batch", "4", "--seq-len", "1024",
                                 "--device", "a100", "--mfu", "0.4"], capsys)
    assert code == 0
    assert "Predicted step time on A100 SXM 80GB" in out
    assert "312 TFLOP/s peak × MFU 0.40" in out
    steps = [line for line in out.splitlines() if line.startswith("│ stage")]
    assert len(steps) >= 4


def test_speed_profile_round_trip_and_bad_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.tools.planner.devices import datasheet, load_profile, save_profile

    save_profile(datasheet("v100"), tmp_path / "v100.json")
    assert load_profile(tmp_path / "v100.json") == datasheet("v100")
    (tmp_path / "bad.json").write_text("{}")
    code, _, err = run_estimate(["--preset", "gpt2", "--speed-profile", str(tmp_path / "bad.json")], capsys)
    assert code == 2 and "not a speed profile" in err
