"""What every model family uses: the plan (plan.py), the steps that apply it in the fixed
order (steps.py) and the kernel rewrites' common parts (kernels.py)."""
