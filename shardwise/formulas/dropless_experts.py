"""Bytes of the dropless expert exchange (docs/formulas.md#expert-parallelism): Mixtral's
routing keeps every token, so what a rank sends depends on where the tokens went.

For one MoE layer call over an expert group of P ranks and E experts (E/P per member),
`routed[q][e]` (token, choice) pairs of member q chose expert e. Member m sends:

    counts     8·(E/P)·(P−1)                 its per-expert counts (int64) to the others
    dispatch   h·b·Σ_{e not m's} routed[m][e]     its rows bound for others' experts
    combine    h·b·Σ_{q≠m} Σ_{e m's} routed[q][e]  the outputs of the rows it received

and in backward each exchange's gradient goes the other way (the combine's as many rows as
the dispatch sent, the dispatch's as many as the combine sent): h hidden size, b bytes per
element. Rows a member routes to its own experts never leave it.
"""

from __future__ import annotations

from collections.abc import Sequence

COUNT_BYTES = 8  # int64 counts


def dropless_exchange_bytes(routed: Sequence[Sequence[int]], *, member: int, hidden_size: int,
                            bytes_per_element: int, backward: bool = True) -> int:
    """Bytes member `member` sends for one layer call, `routed[q][e]` as above."""
    ranks, experts = len(routed), len(routed[0])
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split over {ranks} ranks")
    local = experts // ranks
    sent = sum(count for expert, count in enumerate(routed[member]) if expert // local != member)
    received = sum(routed[other][expert] for other in range(ranks) if other != member
                   for expert in range(member * local, (member + 1) * local))
    rows = (sent + received) * (2 if backward else 1)
    return COUNT_BYTES * local * (ranks - 1) + rows * hidden_size * bytes_per_element
