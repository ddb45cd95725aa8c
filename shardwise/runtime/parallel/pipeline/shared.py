"""Moving the parameters that layers on several pipeline ranks share (split.py,
`SharedParameters`; DeepSpeed's `TiedLayerSpec`).

Before each batch the owner sends, to every other stage using them, their current values
as one flat message; that stage makes the message a leaf tensor and points its modules at
views of it, so its forward and backward use the owner's values and its gradient gathers
in the leaf. After its last backward of the batch it sends that gradient back; the owner
adds it to its own parameters' gradients in its last backward, before the step reduces
them, as if every use had run on one rank.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.runtime.parallel.pipeline.p2p import PipelineChannel, Shapes
from shardwise.runtime.parallel.pipeline.plan import Message
from shardwise.runtime.parallel.pipeline.split import SharedParameters


class SharedExchange:
    """This rank's part in moving shared parameters; the messages go out and come in at
    the steps plan.py gives them ("shared weights" before the first pass, "shared
    gradients" after a user's last backward)."""

    def __init__(self, model: nn.Module, shared: SharedParameters, stage: int):
        self.model = model
        self.shared = shared
        self.stage = stage
        self.leaves: dict[int, torch.Tensor] = {}  # owner stage -> the leaf this rank's views read

    def post_values(self, channel: PipelineChannel) -> None:
        for user, paths in self.shared.sends.items():
            flat = torch.cat([self.model.get_parameter(path).detach().reshape(-1) for path in paths])
            channel.post(Message("shared weights", self.stage, user), flat)

    def take_values(self, channel: PipelineChannel) -> list[torch.Tensor]:
        """Point this rank's modules at the owners' values; returns the leaves (weights,
        not activations, for the caller's accounting)."""
        for owner, entries in self.shared.receives.items():
            leaf = channel.take(Message("shared weights", owner, self.stage))[0]
            leaf.requires_grad_(self.shared.requires_grad[owner])
            offset = 0
            for path, shape in entries:
                module_path, _, name = path.rpartition(".")
                setattr(self.model.get_submodule(module_path), name, leaf[offset : offset + shape.numel()].view(shape))
                offset += shape.numel()
            self.leaves[owner] = leaf
        return list(self.leaves.values())

    def post_gradients(self, channel: PipelineChannel) -> None:
        for owner, leaf in self.leaves.items():
            if self.shared.requires_grad[owner]:
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                channel.post(Message("shared gradients", self.stage, owner), grad)

    def take_gradients(self, channel: PipelineChannel) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The owned parameters and the gradients the other stages computed for them,
        summed per parameter: roots to add to the owner's last backward."""
        summed: dict[str, torch.Tensor] = {}
        for user, paths in self.shared.sends.items():
            if not self.shared.requires_grad[user]:
                continue
            params = {path: self.model.get_parameter(path) for path in paths}
            flat = channel.take(Message("shared gradients", user, self.stage))[0]
            offset = 0
            for path, param in params.items():
                grad = flat[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
                if param.requires_grad:
                    summed[param] = summed[param] + grad if param in summed else grad
        return list(summed), list(summed.values())

    def expect(self, message: Message, dtype: torch.dtype) -> Shapes:
        """(shape, dtype) of a shared-parameter message this rank receives: one flat
        tensor, of the training dtype for values and of the parameters' for gradients."""
        if message.kind == "shared weights":
            return [((sum(shape.numel() for _, shape in self.shared.receives[message.source]),), dtype)]
        params = [self.model.get_parameter(path) for path in self.shared.sends[message.source]]
        return [((sum(param.numel() for param in params),), params[0].dtype)]
