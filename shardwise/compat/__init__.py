"""Compatibility packages: other libraries' APIs on top of shardwise.

`shardwise.compat.deepspeed` is DeepSpeed's Python API (C26). It is never installed
under DeepSpeed's name: `shardwise run --as-deepspeed` makes it importable as
`deepspeed` for that run only (`alias.py`), and a script can also say
`import shardwise.compat.deepspeed as deepspeed`.
"""
