from shardwise.precision.loss_scaler import LossScaler

__all__ = ["LossScaler"]
