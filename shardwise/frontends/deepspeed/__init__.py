"""The DeepSpeed front end: what a DeepSpeed user brings, turned into shardwise's runtime.

- `config/`: DeepSpeed's JSON config, validated (every key honoured, harmless or refused
  with the reason), "auto" filled, and turned into the runtime's typed policies.
- `api/`: DeepSpeed's Python API (C26). It is never installed under DeepSpeed's name:
  `shardwise run --as-deepspeed` makes it importable as `deepspeed` for that run only
  (`alias.py`), and a script can also say `import shardwise.frontends.deepspeed.api as deepspeed`.
"""
