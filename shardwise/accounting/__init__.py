from shardwise.accounting.memory import CATEGORIES, MemoryLedger, tensor_bytes

__all__ = ["CATEGORIES", "MemoryLedger", "tensor_bytes"]
