"""Step-time formulas: how long one optimizer step takes on one rank (docs/formulas.md#step-time).

Plain float arithmetic, no torch, beside the byte formulas it prices (communication.py):
the planner (`shardwise estimate`), the autotuner (`shardwise tune`) and the tests use it.

A step is the sum of what cannot hide behind anything else:

    compute      F·tokens / (peak·MFU)       F = training FLOPs per token, below; tokens =
                                             the rank's share of its replica's tokens
    bubble       compute·(p−1)/m             pipeline of p stages, m micro-batches (1F1B);
                                             less on an oversubscribed CPU, see below
    exposed comm each collective by α–β      (n−1)·α + bytes/β per all-gather or reduce-
                                             scatter (2(n−1)·α for an all-reduce), per
                                             message; what the engine overlaps is hidden
                                             behind the compute it runs beside, see below
    optimizer    bytes moved / bandwidth     the update is memory-bound: the device's
                                             memory bandwidth, or the host's when offloaded
    accumulation bytes moved / bandwidth     fp32 gradient sums beside 16-bit training:
                                             each micro-batch's add, the casts; where the
                                             sums live (the host's partition when offloaded)
    offload      transfers / PCIe, NVMe      gradients down, parameters up, states paged

Training FLOPs per token (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", appendix: 96·B·s·l·h²(1 + s/6h + V/16lh) per
batch with full recomputation, i.e. four passes of this forward):

    forward      2Ψ + 4·L·s·h               every weight once (multiply + add), plus the
                                            attention scores QKᵀ and their product with V
    none         3·forward                  backward costs two forwards
    selective    3·forward + 4·L·s·h        the attention core runs again
    full         4·forward − 2·V·h          the layers' forward runs again (the output
                                            layer's logits, 2·V·h, are not checkpointed)

Overlap, as the engine schedules it (runtime/zero): stages 0-2 reduce gradient buckets
while backward runs, so only what exceeds the backward (and at least the last bucket)
shows; at stages 0-1 with accumulation that is only the window's last backward. Stage 3
prefetches the next unit's gather while the current one computes: forward gathers hide
behind the forward, backward gathers and reduce-scatters behind the backward, except the
first unit of each. `overlap` scales the compute that can hide communication: 1 where
collectives run on their own engines (NCCL on a GPU), less where they take the cores
compute needs (gloo with as many ranks as cores). Stage 1-2's all-gather of the updated
parameters, the replicate group's all-reduce, tensor-parallel collectives (each layer
waits for them) and pipeline sends are exposed.

Oversubscribed CPU (more ranks on a host than it has cores, `host_cores`): the measured
compute rate is each rank's share of the cores with every rank busy, C/R of a core. A phase
in which only b of the R ranks compute runs each at min(1, C/b) of a core instead, so the
same work takes share(R)/share(b) as long (share(n) = min(1, C/n)); the CPU work is
conserved. The pipeline is the one place where ranks of a step idle for long: 1F1B runs
in m + p − 1 slots of compute/m each, slot k with n_k = min(k, p−1) − max(0, k−m+1) + 1
of the p stages busy (the warm-up and cool-down ramps), so the step's compute and bubble
take compute/m · Σ_k share(R)/share(R·n_k/p). With ranks ≤ cores, or a device per rank
(a GPU: an idle stage frees nothing for the others), every factor is 1 and the bubble is
compute·(p−1)/m.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Link:
    """α–β: one message of m bytes between neighbours takes α + m/β."""

    latency_s: float  # α
    bandwidth: float  # β, bytes per second one rank sends

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {self.latency_s} s and "
                             f"{self.bandwidth} B/s")


@dataclass(frozen=True)
class Speeds:
    """What the time model needs to know about the hardware, per device (rank).

    `peak_flops` in the training dtype; `mfu` the fraction of it the model's forward and
    backward reach; `memory_bandwidth` what a memory-bound optimizer update streams at on
    the device; `host_bandwidth` the same for an optimizer offloaded to the CPU (per rank:
    the node's bandwidth shared by its ranks); `pcie_bandwidth` device↔host per rank,
    `nvme_bandwidth` per node; `overlap` as in the module docstring; `host_cores` the cores
    a host's ranks share when they compute on the CPU (0 for devices: GPUs), for the
    oversubscription rule of the module docstring."""

    name: str
    peak_flops: float
    mfu: float
    memory_bandwidth: float
    intra_node: Link
    inter_node: Link
    host_bandwidth: float
    pcie_bandwidth: float
    nvme_bandwidth: float
    overlap: float = 1.0
    source: str = ""
    host_cores: int = 0  # the cores one host's ranks share; 0: every rank has a device of its own

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or not 0 < self.mfu <= 1 or not 0 <= self.overlap <= 1:
            raise ValueError(f"{self.name}: peak_flops must be > 0, mfu in (0, 1], overlap in [0, 1]; got "
                             f"{self.peak_flops}, {self.mfu}, {self.overlap}")
        if self.host_cores < 0:
            raise ValueError(f"{self.name}: host_cores must be >= 0 (0: a device per rank), got {self.host_cores}")
        for key in ("memory_bandwidth", "host_bandwidth", "pcie_bandwidth", "nvme_bandwidth"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{self.name}: {key} must be > 0, got {getattr(self, key)}")

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.mfu


def forward_flops_per_token(num_params: int, *, layers: int, hidden: int, seq_len: int) -> float:
    """2Ψ + 4·L·s·h (see the module docstring)."""
    return 2.0 * num_params + 4.0 * layers * seq_len * hidden


def training_flops_per_token(num_params: int, *, layers: int, hidden: int, seq_len: int,
                             recompute: str = "none", vocab: int = 0) -> float:
    """Forward and backward FLOPs per token, with the recomputation's extra forward work
    (`vocab` V: the output layer full recomputation leaves out; 0 when unknown)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    forward = forward_flops_per_token(num_params, layers=layers, hidden=hidden, seq_len=seq_len)
    extra = {"none": 0.0, "selective": 4.0 * layers * seq_len * hidden,
             "full": forward - 2.0 * vocab * hidden}[recompute]
    return 3.0 * forward + extra


def collective_seconds(op: str, bytes_per_rank: float, ranks: int, link: Link, messages: int = 1) -> float:
    """α–β time of `messages` collectives that together send `bytes_per_rank` from each
    rank (communication.py's ring shares): a ring takes n−1 steps for an all-gather,
    reduce-scatter or all-to-all, 2(n−1) for an all-reduce, each paying α."""
    if ranks <= 1 or bytes_per_rank <= 0:
        return 0.0
    steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
    return messages * steps * link.latency_s + bytes_per_rank / link.bandwidth


def exposed_seconds(comm_s: float, hiding_compute_s: float, overlap: float, last_message_s: float) -> float:
    """Communication beside compute: what the compute cannot cover, and never less than the
    last message, which starts only when the compute before it ends."""
    if comm_s <= 0:
        return 0.0
    return max(min(last_message_s, comm_s), comm_s - overlap * hiding_compute_s)


@dataclass(frozen=True)
class CommTerm:
    """One group's collective in a step: bytes each rank sends, over how many ranks and
    which link, in how many messages, and what it may hide behind."""

    group: str
    op: str
    bytes_per_rank: float
    ranks: int
    link: Link
    messages: int = 1
    hides_behind: str = "none"  # "forward", "backward", "last_backward" or "none"


@dataclass(frozen=True)
class StepWork:
    """One rank's work in one optimizer step, for `step_seconds`."""

    flops: float  # the rank's training FLOPs per step (its share of tensor and pipeline work)
    comm: tuple[CommTerm, ...] = ()
    micro_batches: int = 1  # m: accumulation steps, the pipeline's micro-batches
    pipeline_stages: int = 1  # p
    optimizer_bytes: float = 0.0  # bytes the update streams
    optimizer_on_host: bool = False
    accumulation_bytes: float = 0.0  # fp32 gradient accumulation's adds and casts (`fp32_accumulation_bytes`)
    accumulation_on_host: bool = False  # its sums in the host's partition (optimizer offload, stages 2-3)
    pcie_bytes: float = 0.0  # offload: device↔host per rank
    nvme_bytes_per_node: float = 0.0
    forward_fraction: float = 1.0 / 3.0  # of the compute, the forward's share
    ranks_per_host: int = 1  # ranks sharing one host's cores (Speeds.host_cores)


@dataclass(frozen=True)
class StepTime:
    """Seconds per step by cause; `total` is their sum (each already net of overlap)."""

    compute: float
    bubble: float
    comm: dict[str, float] = field(default_factory=dict)  # exposed seconds per "group op"
    comm_raw: float = 0.0  # the collectives' α–β time before overlap
    optimizer: float = 0.0
    offload: float = 0.0
    accumulation: float = 0.0

    @property
    def exposed_comm(self) -> float:
        return sum(self.comm.values())

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.exposed_comm + self.optimizer + self.offload + self.accumulation


def step_seconds(work: StepWork, speeds: Speeds) -> StepTime:
    """The step's time on `speeds` (module docstring)."""
    compute = work.flops / speeds.achieved_flops
    m, p = work.micro_batches, work.pipeline_stages
    bubble = pipeline_bubble_seconds(compute, stages=p, micro_batches=m, ranks_per_host=work.ranks_per_host,
                                     host_cores=speeds.host_cores)
    forward = compute * work.forward_fraction
    backward = compute - forward
    hiding = {"forward": forward, "backward": backward, "last_backward": backward / m, "none": 0.0}
    exposed: dict[str, float] = {}
    raw = 0.0
    for term in work.comm:
        seconds = collective_seconds(term.op, term.bytes_per_rank, term.ranks, term.link, term.messages)
        raw += seconds
        last = seconds / max(term.messages, 1)
        key = f"{term.group} {term.op}"
        exposed[key] = exposed.get(key, 0.0) + exposed_seconds(seconds, hiding[term.hides_behind],
                                                               speeds.overlap, last)
    bandwidth = speeds.host_bandwidth if work.optimizer_on_host else speeds.memory_bandwidth
    optimizer = work.optimizer_bytes / bandwidth
    offload = work.pcie_bytes / speeds.pcie_bandwidth + work.nvme_bytes_per_node / speeds.nvme_bandwidth
    sums = speeds.host_bandwidth if work.accumulation_on_host else speeds.memory_bandwidth
    return StepTime(compute, bubble, exposed, raw, optimizer, offload, work.accumulation_bytes / sums)


def core_share(busy_ranks: float, cores: int) -> float:
    """The fraction of a core each of `busy_ranks` computing ranks gets on `cores` cores."""
    return min(1.0, cores / busy_ranks)


def pipeline_bubble_seconds(compute_s: float, *, stages: int, micro_batches: int, ranks_per_host: int = 1,
                            host_cores: int = 0) -> float:
    """The pipeline's idle time beyond `compute_s` (module docstring): (p−1)/m of it where
    every rank has its own device or core; on an oversubscribed CPU the ramps' fewer busy
    ranks run faster, so the bubble shrinks (to nothing when the busy ranks alone fill the
    cores)."""
    p, m = stages, micro_batches
    if p == 1:
        return 0.0
    if not host_cores or ranks_per_host <= host_cores:
        return compute_s * (p - 1) / m
    full = core_share(ranks_per_host, host_cores)
    slots = 0.0
    for k in range(m + p - 1):
        busy_stages = min(k, p - 1) - max(0, k - m + 1) + 1
        slots += full / core_share(ranks_per_host * busy_stages / p, host_cores)
    return compute_s * (slots - m) / m


def optimizer_update_bytes(elements: int, *, grad_bytes: int, state_bytes: float, param_bytes: int,
                           fp32_training: bool) -> float:
    """Bytes a memory-bound update streams for `elements` parameters: the gradient read
    twice (the clipping norm, the update), the optimizer's K bytes of state read and
    written, and the weights: with fp32 training the fp32 weights read and written in place
    (K holds no master), with 16-bit training the 16-bit copy written from the master that
    K counts. fp32 AdamW: 4·2 + 8·2 + 8 = 32 bytes per parameter."""
    weights = 2 * 4 if fp32_training else param_bytes
    return elements * (2 * grad_bytes + 2 * state_bytes + weights)


def fp32_accumulation_bytes(*, local: int, partition: int, stage: int, micro_batches: int, grad_bytes: int) -> float:
    """Bytes fp32 gradient accumulation beside 16-bit training (`data_types.grad_accum_dtype`)
    streams per step, as the engine runs it (runtime/zero/gradients.py): at stage 1 each
    micro-batch's g-byte gradient of the `local` elements added into the fp32 buffer (g + 8
    per element), the buffer cast to g bytes for the boundary's reduce-scatter (4 + g) and the
    owned reduced chunk written back in fp32 (g + 4 per `partition` element); at stages 2-3
    each micro-batch's reduced chunk added into the fp32 partition (g + 8). The update then
    reads 4-byte gradients (`optimizer_update_bytes`' grad_bytes). In the training dtype
    autograd sums in place and none of this runs."""
    g = grad_bytes
    if stage <= 1:
        return micro_batches * local * (g + 8) + local * (4 + g) + partition * (g + 4)
    return micro_batches * partition * (g + 8)


def buckets(elements: int, bucket_elements: int) -> int:
    """Messages a bucketed collective of `elements` issues (at least one)."""
    return max(1, ceil(elements / max(bucket_elements, 1)))
