from shardwise.runtime.precision.loss_scaler import LossScaler
from shardwise.runtime.precision.policy import LossScalingPolicy, PrecisionPolicy

__all__ = ["LossScaler", "LossScalingPolicy", "PrecisionPolicy"]
