"""`shardwise run --as-deepspeed`: `import deepspeed` finds shardwise's compatibility
package in that run's processes (and in processes they start), never outside it, and the
script gets DeepSpeed's `--local_rank=<r>` unless --no-local-rank."""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

from shardwise.frontends.deepspeed.alias import as_deepspeed_environment
from shardwise.tools.launcher.cli import _script_environment, add_parser

PROBE = textwrap.dedent(
    """
    import json, os, subprocess, sys
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.ops.adam import FusedAdam
    import shardwise.frontends.deepspeed.api as compat
    from shardwise.frontends.deepspeed.api.ops import adam

    try:
        import deepspeed.no_such_module
        missing = "imported"
    except ModuleNotFoundError as error:
        missing = str(error)
    child = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__name__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    report = {
        "argv": sys.argv[1:], "same_package": deepspeed is compat, "same_class": FusedAdam is adam.FusedAdam,
        "comm": dist.__name__, "spec": deepspeed.__spec__.name, "missing": missing, "child": child,
        "local_size": os.environ.get("LOCAL_SIZE"), "pythonpath": os.environ["PYTHONPATH"],
    }
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump(report, handle)
    """
)


def launch(tmp_path, *flags):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment["PROBE_DIR"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-m", "shardwise.tools.cli.main", "run", "--as-deepspeed", *flags, "--nproc", "2",
                             str(script), "--lr", "0.1"], capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_deepspeed_imports_the_compatibility_package_for_the_run_only(tmp_path):
    for rank, report in enumerate(launch(tmp_path)):
        assert report["argv"] == [f"--local_rank={rank}", "--lr", "0.1"]  # where DeepSpeed's launcher puts it
        assert report["same_package"] and report["same_class"]  # one module object under both names
        assert report["comm"] == "shardwise.frontends.deepspeed.api.comm"
        assert report["spec"] == "shardwise.frontends.deepspeed.api"
        assert "deepspeed.no_such_module" in report["missing"]
        assert report["child"] == "shardwise.frontends.deepspeed.api"  # processes the script starts see it too
        assert report["local_size"] == "2"
        shim = report["pythonpath"].split(os.pathsep)[0]
        assert not os.path.exists(shim)  # removed when the run ended
    spec = importlib.util.find_spec("deepspeed")
    assert spec is None or "shardwise" not in (spec.origin or "")  # nothing installed under DeepSpeed's name


def test_local_rank_argument_and_its_opt_out():
    parser = argparse.ArgumentParser(prog="shardwise")
    add_parser(parser.add_subparsers())
    for flags, expected in (([], ["--local_rank=${local_rank}"]), (["--no-local-rank"], [])):
        args = parser.parse_args(["run", "--as-deepspeed", *flags, "train.py", "--lr", "0.1"])
        with _script_environment(args) as (environment, first_args):
            assert first_args == expected  # torchrun puts each worker's local rank in ${local_rank}
            assert "PYTHONPATH" in environment
        assert args.script_args == ["--lr", "0.1"]
    with _script_environment(parser.parse_args(["run", "train.py"])) as (environment, first_args):
        assert (environment, first_args) == ({}, [])


def test_the_alias_directory_holds_only_the_deepspeed_shim_and_its_metadata():
    with as_deepspeed_environment() as environment:
        directory = environment["PYTHONPATH"].split(os.pathsep)[0]
        assert sorted(os.listdir(directory)) == ["deepspeed", "deepspeed-0.19.8.dist-info"]
        assert sorted(os.listdir(os.path.join(directory, "deepspeed"))) == ["__init__.py"]
        # what Hugging Face's and Accelerate's checks read before they use DeepSpeed
        found = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
                               capture_output=True, text=True, check=True, env={**os.environ, **environment})
        assert found.stdout.strip() == "0.19.8"
    assert not os.path.exists(directory)
