from shardwise.runtime.accounting.memory import CATEGORIES, TIERS, MemoryLedger, tensor_bytes

__all__ = ["CATEGORIES", "TIERS", "MemoryLedger", "tensor_bytes"]
