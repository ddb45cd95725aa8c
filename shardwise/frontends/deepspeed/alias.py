"""`shardwise run --as-deepspeed`: `import deepspeed` finds shardwise's compatibility
package, in that run's processes only.

Nothing named `deepspeed` is installed. For the run, the launcher writes a directory
holding a two-line `deepspeed/__init__.py` and puts it first on the workers'
PYTHONPATH (`as_deepspeed_environment`), with a `deepspeed-<version>.dist-info`
beside it for the libraries that look for DeepSpeed's distribution, so a real DeepSpeed in site-packages is
shadowed for the run and untouched otherwise; processes the script starts (data
loader workers, spawned helpers) inherit the path. When a script imports `deepspeed`,
that file calls `install_alias`: a finder at the front of `sys.meta_path` answers every
`deepspeed.X` import with the module `shardwise.frontends.deepspeed.api.X` itself (one module
object under both names, so classes compare equal whichever name imported them), and
`sys.modules["deepspeed"]` becomes the compatibility package.

Libraries that integrate with DeepSpeed (Hugging Face's `HfDeepSpeedConfig` and
`is_deepspeed_zero3_enabled`, Accelerate) check that the `deepspeed` distribution is
installed, through `importlib.metadata`, before they use it. The run's directory
therefore also holds a `deepspeed-<version>.dist-info` describing the compatibility
package (the version is the DeepSpeed release whose API it follows), and the finder
answers the same metadata to processes that call `install_alias` themselves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, ModuleType

ALIAS = "deepspeed"
DEEPSPEED_API_VERSION = "0.19.8"  # the DeepSpeed release whose Python API the package follows, checked against it
TARGET = "shardwise.frontends.deepspeed.api"
SHIM = '"""Written by `shardwise run --as-deepspeed`; see shardwise/frontends/deepspeed/alias.py."""\n' \
       "from shardwise.frontends.deepspeed.alias import install_alias\n\ninstall_alias()\n"


def distribution_metadata() -> str:
    """The METADATA of the `deepspeed` distribution the alias stands for."""
    return (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {DEEPSPEED_API_VERSION}\n"
            "Summary: shardwise's DeepSpeed compatibility package (shardwise run --as-deepspeed)\n")


class _AliasDistribution(importlib.metadata.Distribution):
    def read_text(self, filename: str) -> str | None:
        return distribution_metadata() if filename == "METADATA" else None

    def locate_file(self, path: str | os.PathLike) -> Path:
        return Path(importlib.util.find_spec(TARGET).origin).parent / path


class _AliasLoader(importlib.abc.Loader):
    """Loads `deepspeed.X` as the already importable `shardwise.frontends.deepspeed.api.X`."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._own_spec  # the import system set the alias's; keep the module's own

    def get_code(self, fullname: str) -> CodeType | None:
        """`python -m deepspeed.X` (runpy asks the loader for the code): X's own code."""
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS):]
        found = importlib.util.find_spec(real)
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real),
                                              is_package=found.submodule_search_locations is not None)

    def find_distributions(self, context: importlib.metadata.DistributionFinder.Context = None):
        """The `deepspeed` distribution, for `importlib.metadata.metadata("deepspeed")`."""
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == ALIAS:
            yield _AliasDistribution()


def install_alias() -> ModuleType:
    """Make `deepspeed` and `deepspeed.X` import the compatibility package; returns it.
    Also fills in the variables DeepSpeed's launcher sets that torchrun names differently."""
    if not any(isinstance(finder, DeepSpeedAliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAliasFinder())
    for deepspeed_name, torchrun_name in (("LOCAL_SIZE", "LOCAL_WORLD_SIZE"), ("CROSS_RANK", "GROUP_RANK"),
                                          ("CROSS_SIZE", "GROUP_WORLD_SIZE")):
        if torchrun_name in os.environ:
            os.environ.setdefault(deepspeed_name, os.environ[torchrun_name])
    package = importlib.import_module(TARGET)
    sys.modules[ALIAS] = package
    return package


@contextmanager
def as_deepspeed_environment() -> Iterator[dict[str, str]]:
    """The environment variables that make the workers' `import deepspeed` find the
    compatibility package, valid while the block runs (the directory is removed after)."""
    with tempfile.TemporaryDirectory(prefix="shardwise-as-deepspeed-") as directory:
        package = Path(directory) / ALIAS
        package.mkdir()
        (package / "__init__.py").write_text(SHIM)
        metadata = Path(directory) / f"{ALIAS}-{DEEPSPEED_API_VERSION}.dist-info"
        metadata.mkdir()
        (metadata / "METADATA").write_text(distribution_metadata())
        paths = [directory, os.environ.get("PYTHONPATH", "")]
        yield {"PYTHONPATH": os.pathsep.join(path for path in paths if path)}
