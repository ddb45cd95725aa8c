"""What every rank of `shardwise train` runs: `python -m shardwise.tools.train.worker OPTIONS_JSON`.

Started by `shardwise.tools.train.launch` through torchrun, which provides the rendezvous
environment that `shardwise.initialize` reads, and OMP_NUM_THREADS, which sets how many
threads torch uses in this rank. Before anything else the rank ties its life to the
launcher's and installs its stop-signal handler; the training modules, and torch with
them, are imported only afterwards, so that neither a launcher killed nor a Ctrl-C
during those seconds of imports is missed.
"""

from __future__ import annotations

import sys

from shardwise.tools.launcher.lifeline import die_with_launcher
from shardwise.tools.train.stopping import StopRequest, exit_code


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    stop = StopRequest().install()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m shardwise.tools.train.worker OPTIONS_JSON", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from shardwise.tools.train.compare import compare_stages
    from shardwise.tools.train.loop import train
    from shardwise.tools.train.options import TrainOptions

    options = TrainOptions.load(argv[0])
    try:
        signum = compare_stages(options, stop) if options.compare_stages else train(options, stop)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return exit_code(signum) if signum else 0


if __name__ == "__main__":
    sys.exit(main())
