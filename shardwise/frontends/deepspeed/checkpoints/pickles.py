"""DeepSpeed's checkpoint files are pickles: read them without running their code, and write
them so DeepSpeed reads them back.

Unpickling an arbitrary file runs whatever it names, so a downloaded checkpoint could run
code on load. `load_pickle` uses `torch.load(weights_only=True)`: tensors and plain
containers only, plus an allow-list of exactly the classes DeepSpeed 0.19.8 pickles into
its checkpoints, each mapped to an inert stand-in here (attributes only, no behaviour):

    deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler   the loss scaler
    deepspeed.runtime.zero.config.ZeroStageEnum                         the ZeRO stage
    deepspeed.utils.tensor_fragment.fragment_address                    a parameter's place in a partition

Anything else is refused naming the file, the type it holds and how to proceed: a file
the user trusts can be read with `trusted=True` (`--trust-pickles` on the command line),
which is torch's unrestricted `torch.load` and runs the file's code (it then needs the
classes it names to be importable; DeepSpeed's own are still read as the stand-ins).

Writing goes the other way: DeepSpeed loads our files with its own classes, so the
stand-ins are pickled under DeepSpeed's names (`save_pickle`), without DeepSpeed installed.
"""

from __future__ import annotations

import enum
import io
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import torch

from shardwise.runtime.checkpoint.format import CheckpointError


class LossScaler:
    """DeepSpeed's static loss scaler (`cur_scale`, `dynamic` = False), as pickled."""

    def __init__(self, **attributes: Any):
        self.__dict__.update(attributes)


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler: `cur_scale`, `cur_iter`, `last_overflow_iter`,
    `scale_factor`, `scale_window`, `min_scale`, `delayed_shift`, `cur_hysteresis`,
    `consecutive_hysteresis`, `raise_error_at_min_scale`, `dynamic`, `dtype`."""


class ZeroStageEnum(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class FragmentAddress:
    """Where a parameter's fragment sits in a rank's flat partition: `start`, `numel`."""

    def __init__(self, **attributes: Any):
        self.__dict__.update(attributes)


DEEPSPEED_NAMES: dict[Any, str] = {
    LossScaler: "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    DynamicLossScaler: "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    ZeroStageEnum: "deepspeed.runtime.zero.config.ZeroStageEnum",
    FragmentAddress: "deepspeed.utils.tensor_fragment.fragment_address",
}
TRUST_HINT = ("if you trust this file (you or DeepSpeed wrote it), load it with trusted=True "
              "(`shardwise convert --from-deepspeed --trust-pickles`, load_checkpoint(..., trust_pickles=True), or "
              "SHARDWISE_TRUST_PICKLES=1 for a DeepSpeed script), which lets the file run code as "
              "torch.load(weights_only=False) does")
_SAFE_GLOBALS = [(stand_in, name) for stand_in, name in DEEPSPEED_NAMES.items()]
_STAND_INS = {name: stand_in for stand_in, name in DEEPSPEED_NAMES.items()}
# torch keeps the allow-list in one process-wide set; ranks run as threads in tests, so
# adding and removing it is serialised
_ALLOW_LIST_LOCK = threading.Lock()
_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_pickle(path: Path, *, trusted: bool = False) -> Any:
    """The object a DeepSpeed checkpoint file holds, on the CPU, memory-mapped where the file
    allows it (so a rank's memory holds only what it reads)."""
    if trusted:
        return _torch_load(path, weights_only=False)
    with _ALLOW_LIST_LOCK, torch.serialization.safe_globals(_SAFE_GLOBALS):
        try:
            return _torch_load(path, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(_refusal(path, str(error))) from None


def _torch_load(path: Path, *, weights_only: bool) -> Any:
    # trusted: any class, DeepSpeed's own read as the stand-ins (DeepSpeed need not be installed)
    options = {} if weights_only else {"pickle_module": _TrustingPickleModule}
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True, **options)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {error}") from None
    return torch.load(path, map_location="cpu", weights_only=weights_only, **options)  # a legacy (pre-zip) file


def _refusal(path: Path, message: str) -> str:
    found = _UNSUPPORTED_GLOBAL.search(message)
    what = (f"a pickled {found.group(1)}" if found else
            f"pickled content that is not plain data ({message.splitlines()[0].strip()})")
    return (f"refusing to load {path}: it holds {what}, which is not among the types DeepSpeed writes into its "
            f"checkpoints (tensors, containers, its loss scaler, ZeRO stage and fragment addresses), so loading "
            f"it could run code from the file; {TRUST_HINT}")


class _DeepSpeedPickler(pickle._Pickler):
    """Python's pickler, naming the stand-ins as the DeepSpeed classes they stand for (the C
    pickler insists that a class be importable under the name it writes)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        qualified = DEEPSPEED_NAMES.get(obj)
        if qualified is None:
            return super().save_global(obj, name)
        module, _, attribute = qualified.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(attribute)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{attribute}\n".encode())
        self.memoize(obj)


class _TrustingUnpickler(pickle.Unpickler):
    """Python's unpickler (it imports what the file names), with DeepSpeed's classes answered
    by the stand-ins."""

    def find_class(self, module: str, name: str) -> Any:
        stand_in = _STAND_INS.get(f"{module}.{name}")
        return stand_in if stand_in is not None else super().find_class(module, name)


class _TrustingPickleModule:
    """What torch.load asks of its `pickle_module` for a trusted file."""

    Unpickler = _TrustingUnpickler
    load = pickle.load
    __name__ = "shardwise_trusted_deepspeed_pickle"


class _PickleModule:
    """What torch.save asks of its `pickle_module`."""

    Pickler = _DeepSpeedPickler
    Unpickler = pickle.Unpickler
    __name__ = "shardwise_deepspeed_pickle"


def save_pickle(value: Any, path: Path) -> None:
    """torch.save `value` to `path` as DeepSpeed's files are (zip format, pickle protocol 2)."""
    buffer = io.BytesIO()
    torch.save(value, buffer, pickle_module=_PickleModule)
    path.write_bytes(buffer.getvalue())
