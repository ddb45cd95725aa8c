"""Training runs for the Hugging Face family tests: one call per rank at tensor_parallel.size 2
or pipeline_parallel.size 2, and the single-process reference on the same global batches.

Each family is a tiny random model built from its config (nothing downloaded), seeded
alike on every rank. A step is m micro-batches of b rows, accumulated in the same order by
the reference, so the mean of the micro-batch losses is the step's loss. The optimizer is
SGD with momentum and clipping (tests/runtime/parallel/workers.py says why, not Adam).
Each rank returns its parameters whole (gathered over the tensor group) under their
original names (the pipeline test merges the two stages' disjoint sets), and how many
checkpointed regions ran (activation_checkpointing.profile).
"""

from __future__ import annotations

import dataclasses

import torch

import shardwise
from shardwise.runtime.activation.apply import checkpoint_stats
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.tensor import gather_full, tensor_shard
from tests.runtime.parallel.workers import make_optimizer
from tests.runtime.zero.workers import SEQ_LEN, VOCAB, global_batch

ENCODERS = ("bert", "roberta")
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=SEQ_LEN)


@dataclasses.dataclass(frozen=True)
class FamilyCase:
    family: str
    tensor: int = 1
    pipeline: int = 1
    steps: int = 2
    micro_batches: int = 2
    micro_batch: int = 2
    lr: float = 0.05
    clipping: float = 0.5
    recompute: str | None = None  # activation_checkpointing.policy, applied through the family's plan
    split_points: tuple[int, ...] | None = None  # pipeline_parallel.split_points (else balanced by parameters)
    save_to: str | None = None  # a directory the trained engine saves a checkpoint to

    def config(self) -> dict:
        recompute = {"activation_checkpointing": {"policy": self.recompute, "profile": True}} if self.recompute else {}
        return {
            **recompute,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.micro_batches,
            "gradient_clipping": self.clipping,
            "tensor_parallel": {"size": self.tensor},
            "pipeline_parallel": {"size": self.pipeline, "schedule": "1f1b",
                                  **({"split_points": list(self.split_points)} if self.split_points else {})},
        }


def build_model(family: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(1234)
    if family == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, num_key_value_heads=2, head_dim=8))
    if family == "gemma2":  # sliding-window and full layers alternate; logits soft-capped
        config = transformers.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                           attn_implementation="eager")
        return transformers.Gemma2ForCausalLM(config)
    if family == "gemma3":  # q/k norms, local and global rotary embeddings
        config = transformers.Gemma3TextConfig(**SMALL, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                               layer_types=["sliding_attention", "full_attention"])
        return transformers.Gemma3ForCausalLM(config)
    if family == "qwen3":  # q/k norms per head
        config = transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=8)
        return transformers.Qwen3ForCausalLM(config)
    if family.startswith("phi3"):  # fused qkv_proj (4 query heads, 2 key/value heads) and gate_up_proj
        kv_heads = {"phi3": 2, "phi3_one_kv_head": 1}[family]
        config = transformers.Phi3Config(**SMALL, num_key_value_heads=kv_heads, pad_token_id=0, bos_token_id=0,
                                         eos_token_id=0)
        return transformers.Phi3ForCausalLM(config)
    if family == "mixtral":  # 4 experts, 2 per token
        config = transformers.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    if family.startswith("falcon"):  # query_key_value fused per key/value group, multi-query, or per head
        layouts = {"falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
                   "falcon_multi_query": dict(multi_query=True),
                   "falcon_per_head": dict(multi_query=False, parallel_attn=False, bias=True)}
        config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, ffn_hidden_size=64, max_position_embeddings=SEQ_LEN,
                                           hidden_dropout=0.0, attention_dropout=0.0, **layouts[family])
        return transformers.FalconForCausalLM(config)
    if family.startswith("t5"):  # encoder-decoder, relative position bias; tied head, or untied with a gated MLP
        variant = {"t5": dict(tie_word_embeddings=True),
                   "t5_gated": dict(tie_word_embeddings=False, feed_forward_proj="gated-gelu")}[family]
        config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                       num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                       dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **variant)
        return transformers.T5ForConditionalGeneration(config)
    if family in ("bert", "roberta"):  # encoders with the MLM head tied to the word embeddings
        name = {"bert": "Bert", "roberta": "Roberta"}[family]
        config = getattr(transformers, f"{name}Config")(
            **{**SMALL, "max_position_embeddings": SEQ_LEN + 2}, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
        return getattr(transformers, f"{name}ForMaskedLM")(config)
    raise ValueError(family)


def micro_batches(case: FamilyCase, step: int) -> list[dict]:
    x, _ = global_batch(step, case.micro_batches * case.micro_batch)
    rows = [x[i * case.micro_batch:(i + 1) * case.micro_batch] for i in range(case.micro_batches)]
    if case.family in ENCODERS:  # a masked LM predicts a quarter of the positions
        hidden = torch.rand(x.shape, generator=torch.Generator().manual_seed(step)) < 0.75
        return [{"input_ids": ids, "labels": ids.masked_fill(skip, -100)}
                for ids, skip in zip(rows, hidden.split(case.micro_batch))]
    if case.family.startswith("t5"):  # the decoder learns to reverse the input; T5 shifts the labels right itself
        return [{"input_ids": ids, "labels": ids.flip(1)} for ids in rows]
    return [{"input_ids": ids, "labels": ids} for ids in rows]  # Hugging Face shifts the labels itself


def train_reference(case: FamilyCase) -> dict:
    model = build_model(case.family)
    return train_one_process(model, make_optimizer(model, case.lr), [micro_batches(case, step)
                                                                     for step in range(case.steps)], case.clipping)


def train_one_process(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: list[list[dict]],
                      clipping: float) -> dict:
    """The reference: each step's micro-batches accumulated in one process (mean loss),
    clipped, stepped; the losses and the final weights."""
    losses = []
    for batches in steps:
        total = torch.zeros(())
        for batch in batches:
            loss = model(**batch).loss / len(batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total.item())
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def train_parallel(rank: int, world_size: int, case: FamilyCase) -> dict:
    model = build_model(case.family)
    engine = shardwise.initialize(model, case.config(), optimizer=make_optimizer(model, case.lr))
    losses = []
    for step in range(case.steps):
        batches = micro_batches(case, step)
        if engine.pipeline is not None:
            losses.append(engine.train_batch(data_iter=iter(batches)).item())
            continue
        total = 0.0
        for batch in batches:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / case.micro_batches
        losses.append(total)
    if case.save_to is not None:
        engine.save_checkpoint(case.save_to)
    tensor = Communicator(engine.mesh["tensor"])
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {name: gather_full(p.detach().float(), tensor_shard(p), tensor).cpu()
                  for name, p in model.named_parameters()}
    stats = checkpoint_stats(model)
    return {"losses": losses, "params": params, "recomputed_regions": stats.regions if stats else 0}
