"""Training the experts of expert-parallel layers beside ZeRO's dense parameters.

With expert-parallel size P over D data-parallel ranks, a rank holds 1/P of each layer's
experts, and the D/P ranks at its place in every expert group (the expert-data group)
hold the same ones. Its experts' gradients already carry every token of its expert group
(the all-to-all's backward brought them home), so summing them over the expert-data
group gives the sum over all D ranks, and dividing by D gives the gradient of the mean
of the ranks' losses: what ZeRO gives the dense parameters, which it reduces over the
data-parallel ranks as always. Summing an expert's gradient with the dense ones over
all D ranks would mix different experts that sit in the same place on different ranks,
so the experts stay out of ZeRO's flat buffers: each rank keeps its experts whole (they
are already 1/P of the experts, at any ZeRO stage, stage 3 included) and steps them with
an optimizer of its own, built from the caller's expert param groups.

In bf16 or fp16 training the buffer is 16-bit and the optimizer steps an fp32 copy of the
slice (the master), rounded back into the buffer after each update, as ZeRO does for the
dense parameters. fp16's loss scale reaches the experts' gradients through the same
backward; their squares join the step check's norm (`norm_squared_share`), so an
overflow in any expert on any rank makes the norm non-finite on every rank and the step
is skipped everywhere, and an applied step unscales them with the dense ones.

At ZeRO stages 1-3 the experts' optimizer state is partitioned over the expert-data
group, as DeepSpeed's ZeRO does for expert groups: each param group's experts of one
size live in one flat buffer (the parameters become views of it), padded to a multiple
of N = D/P; a rank's optimizer steps only its 1/N slice of the buffer (a parameter that
shares the buffer's storage, so no copy), the gradients are reduce-scattered into that
slice instead of all-reduced, and the updated slices are all-gathered back into the
buffer. At stage 0 the slice is the whole buffer and the gradients are all-reduced.

The ledger counts what is held: a local expert's whole gradient (compute dtype) from
when autograd creates it until `reduce_gradients` has copied it into the reduction's
fp32 buffer and freed it; that buffer as a transient buffer while it is reduced; the
slice of the summed gradient the optimizer steps (`master.grad`: 1/N of the padded
bucket, or all of it at stage 0) until `zero_grads`; and the flat buffer's padding as
parameters (the parameters themselves are counted by the engine, as whole parameters
ZeRO does not hold).

The global gradient norm counts each expert once: partitioned, a rank adds the squares
of its slice (every element is in exactly one rank's slice of its expert-data group);
whole, its experts' squares divided by the D/P ranks holding copies of them. Under tensor
parallelism the tensor group's norm sums every rank's share (tensor/grad_norm.py): an
expert's parameter split by the group counts as it is, one the group keeps whole (a
row-parallel expert's bias) is divided by the tensor size.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.accounting.memory import tensor_bytes
from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.distributed.peers import PeerDirectory
from shardwise.runtime.parallel.expert.marking import ExpertParallelLayer, ExpertPlace, expert_parallel_size
from shardwise.runtime.parallel.tensor.placement import is_tensor_sharded

BuildOptimizer = Callable[[list[dict]], torch.optim.Optimizer]


class ExpertBucket:
    """One param group's experts of one expert-parallel size, in one flat buffer of the
    compute dtype, and what this rank's optimizer steps: `master`, its slice of the buffer
    (sharing its storage) in fp32 training, an fp32 copy of that slice in bf16 or fp16."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], *, size: int, group: int, comm: Communicator,
                 partitioned: bool, dtype: torch.dtype, ledger: MemoryLedger, tensor_size: int = 1):
        self.params, self.size, self.group, self.comm, self.ledger = params, size, group, comm, ledger
        self.tensor_size = tensor_size
        self.partitioned = partitioned and comm.size > 1
        parts = comm.size if self.partitioned else 1
        self.numel = sum(param.numel() for _, param in params)
        padded = -(-self.numel // parts) * parts
        first = params[0][1]
        self.flat = torch.zeros(padded, dtype=dtype, device=first.device)
        ledger.hold("params", (padded - self.numel) * self.flat.element_size())  # the parameters: by the engine
        offset = 0
        with torch.no_grad():
            for _, param in params:
                self.flat[offset : offset + param.numel()].copy_(param.reshape(-1))
                param.data = self.flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
        width = padded // parts
        self.start = (comm.rank if self.partitioned else 0) * width  # the slice's place in the buffer
        self.slice = self.flat[self.start : self.start + width]
        self.master = nn.Parameter(self.slice if dtype == torch.float32 else self.slice.float())

    @property
    def writes(self) -> bool:
        """Whether this rank writes the slice to a checkpoint: each slice once (whole
        slices are alike on every replica, so the first one writes)."""
        return self.partitioned or self.comm.rank == 0

    def owned_pieces(self) -> list[tuple[int, int, int, int]]:
        """(parameter index, start, stop within the flattened parameter, position in the
        slice) of every parameter range inside this rank's slice."""
        low, high = self.start, self.start + self.master.numel()
        pieces, offset = [], 0
        for index, (_, param) in enumerate(self.params):
            first, last = max(low, offset), min(high, offset + param.numel())
            if first < last:
                pieces.append((index, first - offset, last - offset, first - low))
            offset += param.numel()
        return pieces

    def reduce_gradients(self, data_size: int, free_grad: Callable[[nn.Parameter], None]) -> None:
        """The mean gradient over the D ranks, into `master.grad` (its slice only, partitioned).
        Each parameter's gradient is copied into one fp32 buffer and freed (`free_grad`);
        partitioned, that buffer is only the reduce-scatter's input, and the rank keeps a
        slice of its own."""
        full = torch.zeros(self.flat.numel(), dtype=torch.float32, device=self.flat.device)
        self.ledger.hold("buffers", tensor_bytes(full))
        offset = 0
        for _, param in self.params:
            if param.grad is not None:  # an expert no token reached has none: its zeros stay
                full[offset : offset + param.numel()].copy_(param.grad.reshape(-1))
            free_grad(param)
            offset += param.numel()
        what = f"expert gradients (ep_size {self.size})"
        if self.partitioned:
            grad = torch.empty(self.slice.numel(), dtype=torch.float32, device=full.device)
            self.comm.reduce_scatter(grad, full, what).wait()
        else:
            self.comm.all_reduce(full, what).wait()
            grad = full
        self.ledger.release("buffers", tensor_bytes(full))
        del full
        self.ledger.hold("grads", tensor_bytes(grad))
        self.master.grad = grad.div_(data_size)

    def free_master_grad(self) -> None:
        if self.master.grad is not None:
            self.ledger.release("grads", tensor_bytes(self.master.grad))
            self.master.grad = None

    def norm_squared(self, data_size: int) -> torch.Tensor:
        """This rank's share of the squared norm of the experts' gradient (each counted once)."""
        grad = self.master.grad
        squares = torch.linalg.vector_norm(grad, dtype=torch.float32).cpu().square()
        if self.tensor_size > 1:  # parameters whole on every tensor rank: each rank counts 1/N of them
            for index, start, stop, at in self.owned_pieces():
                if not is_tensor_sharded(self.params[index][1]):
                    whole = torch.linalg.vector_norm(grad[at : at + stop - start], dtype=torch.float32).cpu()
                    squares -= whole.square() * (1 - 1 / self.tensor_size)
        return squares if self.partitioned else squares / (data_size // self.size)  # whole: D/P copies

    def after_step(self) -> None:
        """The updated master into this rank's slice (bf16: rounded), and every replica's
        slice into every replica's buffer."""
        if self.master.data_ptr() != self.slice.data_ptr():
            with torch.no_grad():
                self.slice.copy_(self.master)
        if self.partitioned:
            self.comm.all_gather(self.flat, self.slice.detach(), f"updated experts (ep_size {self.size})").wait()


class ExpertTraining:
    """The experts' gradients, norm and update; the engine calls it beside ZeRO's."""

    def __init__(self, params: list[tuple[str, nn.Parameter, int]], groups: list[dict], build: BuildOptimizer,
                 expert_data: dict[int, Communicator], *, data_size: int, partitioned: bool, ledger: MemoryLedger,
                 global_places: dict[int, ExpertPlace], dtype: torch.dtype = torch.float32, tensor_size: int = 1):
        """`params`: (name, parameter, expert-parallel size); `groups`: the experts' param
        groups (their hyper-parameters); `build`: the optimizer over param groups;
        `expert_data`: the expert-data communicator for each size; `data_size`: D;
        `partitioned`: the optimizer state split over the expert-data group (ZeRO >= 1);
        `global_places`: where each expert parameter lies in the every-expert model, by id;
        `dtype`: of the parameters the model computes with (bf16, fp16: fp32 masters apart);
        `tensor_size`: of the tensor group (the norm counts parameters it keeps whole once)."""
        self.params = params
        self.global_places = global_places
        self.data_size = data_size
        self.ledger = ledger
        names = {id(param): (name, size) for name, param, size in params}
        self.buckets: list[ExpertBucket] = []
        optimizer_groups = []
        for index, group in enumerate(groups):
            for size in sorted({names[id(param)][1] for param in group["params"]}):
                members = [(names[id(param)][0], param) for param in group["params"] if names[id(param)][1] == size]
                bucket = ExpertBucket(members, size=size, group=index, comm=expert_data[size],
                                      partitioned=partitioned, dtype=dtype, ledger=ledger, tensor_size=tensor_size)
                self.buckets.append(bucket)
                optimizer_groups.append({**{key: value for key, value in group.items() if key != "params"},
                                         "params": [bucket.master]})
        self.optimizer = build(optimizer_groups)
        self._counted_state = 0
        self._held_grads: dict[int, int] = {}  # id of a local expert parameter -> its gradient's bytes in the ledger
        training = weakref.ref(self)  # a hook must not keep a destroyed engine's experts alive

        def count(param: nn.Parameter) -> None:
            if (alive := training()) is not None:
                alive._count_grad(param)

        self._hooks = [param.register_post_accumulate_grad_hook(count) for _, param, _ in params]

    @staticmethod
    def split_optimizer(optimizer: torch.optim.Optimizer, experts: set[int]) -> tuple[list[dict], dict[int, int]]:
        """Take the param groups holding experts out of `optimizer` (in place): (the expert
        groups, old dense group index -> new). A group mixing experts and dense parameters
        cannot be split in two and keep one set of hyper-parameters, so it is refused."""
        expert_groups, kept, index = [], [], {}
        for position, group in enumerate(optimizer.param_groups):
            held = [id(param) in experts for param in group["params"]]
            if any(held) and not all(held):
                raise ValueError("an optimizer param group holds both expert and dense parameters; with ep_size > 1 "
                                 "the experts train apart: put them in groups of their own "
                                 "(split_params_into_different_moe_groups_for_optimizer)")
            if held and all(held):
                expert_groups.append(group)
            else:
                index[position] = len(kept)
                kept.append(group)
        optimizer.param_groups[:] = kept
        return expert_groups, index

    def _count_grad(self, param: nn.Parameter) -> None:
        """Hold a local expert's gradient in the ledger when autograd creates it (later
        micro-batches accumulate into the same tensor)."""
        if id(param) not in self._held_grads:
            self._held_grads[id(param)] = tensor_bytes(param.grad)
            self.ledger.hold("grads", self._held_grads[id(param)])

    def _free_grad(self, param: nn.Parameter) -> None:
        param.grad = None
        self.ledger.release("grads", self._held_grads.pop(id(param), 0))

    def reduce_gradients(self) -> None:
        """Each expert's gradient summed over its expert-data group and divided by D, into
        the slices the optimizer steps."""
        for bucket in self.buckets:
            bucket.reduce_gradients(self.data_size, self._free_grad)

    def norm_squared_share(self, replicate_size: int) -> torch.Tensor:
        """This rank's part of the squared gradient norm, in the step guard's units (it
        divides every rank's share by `replicate_size` and sums over the D ranks)."""
        total = torch.zeros((), dtype=torch.float32)
        for bucket in self.buckets:
            total += bucket.norm_squared(self.data_size)
        return total * replicate_size

    def step(self, grad_scale: float) -> None:
        if grad_scale != 1.0:
            for bucket in self.buckets:
                bucket.master.grad.mul_(grad_scale)
        self.optimizer.step()
        for bucket in self.buckets:
            bucket.after_step()
        self.count_state_bytes()

    def state_bytes(self) -> int:
        """Bytes of the optimizer's per-element state this rank holds for the experts, and
        of their fp32 masters where those are copies (bf16), as ZeRO counts its own."""
        states = sum(value.numel() * value.element_size() for bucket in self.buckets
                     for value in self.optimizer.state.get(bucket.master, {}).values()
                     if torch.is_tensor(value) and value.dim() > 0)
        masters = sum(bucket.master.numel() * bucket.master.element_size() for bucket in self.buckets
                      if bucket.master.data_ptr() != bucket.slice.data_ptr())
        return states + masters

    def count_state_bytes(self) -> None:
        """Add the experts' optimizer state to the ledger's: ZeRO sets its own total after
        every step it takes (before the experts step), so the experts hold theirs on top."""
        self.ledger.hold("optimizer_states", self.state_bytes())

    def remove_hooks(self) -> None:
        """Stop counting the experts' gradients (the engine is detached; a later engine on
        the same model adds its own hooks)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def zero_grads(self) -> None:
        for _, param, _ in self.params:
            self._free_grad(param)
        for bucket in self.buckets:
            bucket.free_master_grad()


def expert_parameters(named: list[tuple[str, nn.Parameter, int]]) -> list[tuple[str, nn.Parameter, int]]:
    """(name, parameter, expert-parallel size) of the marked parameters split over > 1 rank."""
    return [(name, param, size) for name, param, _ in named
            if (size := expert_parallel_size(param)) is not None and size > 1]


def global_expert_places(model: nn.Module) -> dict[int, ExpertPlace]:
    """Where each expert parameter of `model` lies in the every-expert model, by id (the
    layers place their experts, `ExpertParallelLayer.global_expert_place`)."""
    places = {}
    for path, layer in model.named_modules():
        if isinstance(layer, ExpertParallelLayer) and layer.expert_parallel_size > 1:
            for name, param in layer.named_parameters():
                if expert_parallel_size(param) is not None:
                    places[id(param)] = layer.global_expert_place(name).under(path)
    return places


def connect_expert_layers(model: nn.Module, mesh: ParallelMesh, stats: CommStats, ledger: MemoryLedger,
                          peers: PeerDirectory | None) -> bool:
    """Give every expert-parallel layer of `model` its expert group (created on the mesh
    once per size, in module order, alike on every rank); whether there was one."""
    layers = [module for module in model.modules()
              if isinstance(module, ExpertParallelLayer) and module.expert_parallel_size > 1]
    for layer in layers:
        expert, _ = mesh.expert_handles(layer.expert_parallel_size)
        layer.use_expert_groups(Communicator(expert, stats, ledger, peers))
    return bool(layers)
