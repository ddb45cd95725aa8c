"""One optimizer step on zero gradients, which DeepSpeed's mixed-precision optimizer
wrappers take when they are built (`initialize_optimizer_states` of its FP16_Optimizer
and FP16_UnfusedOptimizer) to create the optimizer's state.

The step is not neutral: it counts as the optimizer's first (Adam's bias correction then
starts at its second step, so its first updates are smaller) and applies weight decay
once. It steps every group, MoE experts' included (checked against DeepSpeed 0.19.8 at
stage 0 in bf16 and fp16 with ep_size 2: every parameter's Adam state at step 1 after
`initialize`), and updates only the optimizer's parameters (fp32 masters beside 16-bit
weights): the weights the model computes with take the change at the first real step, as
DeepSpeed copies its masters only then. Configs that DeepSpeed trains that way train the
same here (runtime/precision/policy.py, `initial_zero_gradient_step`).
"""

import torch


def step_on_zero_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Step `optimizer` once with every parameter's gradient zero, then leave no gradients."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for param in params:
        param.grad = None
