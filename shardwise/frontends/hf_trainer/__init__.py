"""Integrations with other training frameworks.

`shardwise.frontends.hf_trainer.trainer.ShardwiseTrainer`: Hugging Face's `Trainer` training
through a shardwise engine (needs the `transformers` extra). Nothing is imported here, so
`import shardwise` never pulls in `transformers`.
"""
