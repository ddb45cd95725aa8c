"""The TRL releases the shardwise TRL trainers are tested against.

They keep TRL's own training step and change two things TRL decides inside its
constructors: the reference model (prepared by TRL for DeepSpeed with `prepare_deepspeed`)
and, through `ShardwiseTrainer`, the Trainer's internal methods. Both move between TRL
releases (1.x renamed and re-laid-out the trainers more than once), so a release outside
the tested range would fail inside a step, or train differently. The check runs when
`shardwise.frontends.trl.trainers` is imported, before TRL is; the same range is pinned in
pyproject.toml's `trl` extra.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardwise.frontends.releases import require_releases

# Tested: trl 1.16.0 with transformers 5.23.0 and accelerate 1.15.0. Widen only after
# running tests/frontends/trl with the new release.
SUPPORTED = {"trl": ">=1.16,<1.17"}
EXTRA = "pip install 'shardwise[trl]'"


def check_versions(installed: Mapping[str, str | None] | None = None) -> None:
    """Raise ImportError unless TRL is installed at a supported version. `installed`
    (package -> version, None for missing) defaults to this environment's."""
    require_releases(SUPPORTED, user="shardwise_trainer", extra=EXTRA, installed=installed,
                     reason="The shardwise TRL trainers replace how TRL prepares its reference model, which changes "
                            "between releases")
