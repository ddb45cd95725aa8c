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
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

ALIAS = "deepspeed"
API_VERSION = "0.19.8"  # the DeepSpeed release the compatibility package is compared with (tests/frontends/deepspeed)
TARGET = "shardwise.frontends.deepspeed.api"
SHIM = '"""Written by `shardwise run --as-deepspeed`; see shardwise/frontends/deepspeed/alias.py."""\n' \
       "from shardwise.frontends.deepspeed.alias import install_alias\n\ninstall_alias()\n"


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
        # Libraries that check for DeepSpeed by its installed distribution (accelerate's
        # `is_deepspeed_available`, transformers' `TrainingArguments(deepspeed=...)`) find one
        # beside the package, naming the DeepSpeed release whose API it reproduces.
        metadata = Path(directory) / f"{ALIAS}-{API_VERSION}.dist-info"
        metadata.mkdir()
        (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {API_VERSION}\n"
                                           "Summary: shardwise's DeepSpeed compatibility package (shardwise run "
                                           "--as-deepspeed)\n")
        paths = [directory, os.environ.get("PYTHONPATH", "")]
        yield {"PYTHONPATH": os.pathsep.join(path for path in paths if path)}
