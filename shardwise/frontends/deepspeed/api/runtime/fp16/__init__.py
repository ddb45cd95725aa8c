"""`deepspeed.runtime.fp16`: the loss scalers (`loss_scaler`), which scripts import to allow
them in `torch.load(weights_only=True)` and to drive fp16 training loops of their own."""

from shardwise.frontends.deepspeed.api.runtime.fp16 import loss_scaler

__all__ = ["loss_scaler"]
