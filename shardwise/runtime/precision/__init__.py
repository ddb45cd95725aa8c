from shardwise.runtime.precision.loss_scaler import LossScaler

__all__ = ["LossScaler"]
