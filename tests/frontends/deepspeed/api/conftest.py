"""tests/frontends/deepspeed/api: DeepSpeed's API and unmodified DeepSpeed-shaped scripts (C26).

The script tests launch real jobs (`shardwise run --as-deepspeed`, several seconds each);
the default run covers every script at least at one ZeRO stage, and the rest of the
stage x script matrix is marked `slow`: it runs with `-m slow` or SHARDWISE_SLOW_TESTS=1
(tests/conftest.py).
"""
