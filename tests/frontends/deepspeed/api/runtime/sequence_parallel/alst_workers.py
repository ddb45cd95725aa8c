"""Rank functions for test_ulysses_sp.py: DeepSpeed's ALST loop as its tutorial writes it
(register_with_transformers, initialize with the mpu, the adapter, the token-weighted loss)
through `import deepspeed`, and the single-process reference it must equal."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

VOCAB = 64
LR, EPS, WEIGHT_DECAY = 1e-2, 1e-4, 0.01  # eps 1e-4: tests/runtime/zero/workers.py ADAM_EPS
# four sequences, two per rank's loader: a refill takes one from each (lengths may differ
# between ranks, and between refills); the first has its prompt's labels masked
LENGTHS = (16, 16, 8, 12)
MASKED_PROMPT = (3, 0, 0, 5)
# one entry per tile the tiled MLP / loss computed (forward and recomputed)
tiles_run: dict[str, list[int]] = {"mlp": [], "loss": []}


def tiny_llama(kv_heads: int = 1) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def samples() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for length, masked in zip(LENGTHS, MASKED_PROMPT):
        ids = torch.randint(0, VOCAB, (length,), generator=generator)
        labels = ids.clone()
        labels[:masked] = -100
        out.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(length)})
    return out


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([sample[key] for sample in batch]) for key in batch[0]}


def reference(model: torch.nn.Module, order: list[int], accumulation: int) -> tuple[list[float], dict]:
    """Whole sequences in one process, in the order the sequence group trains them; one
    optimizer step per `accumulation` sequences (each loss the mean over its tokens)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY)
    data = samples()
    losses = []
    for index, which in enumerate(order):
        batch = collate([data[which]])
        loss = model(**batch).loss
        losses.append(loss.item())
        (loss / accumulation).backward()
        if (index + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    return losses, {name: param.detach().clone() for name, param in model.named_parameters()}


def tile_llama_mlp() -> None:
    """ALST's tiled MLP in every Llama MLP, as DeepSpeed's TiledMLP docstring patches it."""
    from transformers.models.llama import modeling_llama

    from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp(module, x):
        tiles_run["mlp"].append(x.shape[-2])
        return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))

    def tiled_forward(self, x):
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp, self, x, 3, params)

    modeling_llama.LlamaMLP.forward = tiled_forward


def tile_llama_loss() -> None:
    """The shard's loss through ALST's TiledFusedLogitsLoss (logits for 2 tiles of tokens at a
    time), computed inside the model's forward from `shift_labels` as ArcticTraining does."""
    from types import SimpleNamespace

    from transformers.models.llama import modeling_llama

    from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    def summed_loss(head, x, y):
        tiles_run["loss"].append(x.shape[0])
        return torch.nn.functional.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")

    def forward(self, input_ids, position_ids, shift_labels):
        hidden = self.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        total = TiledFusedLogitsLoss.apply(summed_loss, self.lm_head, hidden, shift_labels, None, 2,
                                           [self.lm_head.weight], "sum")
        return SimpleNamespace(loss=total / (shift_labels != -100).sum().clamp_min(1))

    modeling_llama.LlamaForCausalLM.forward = forward


def alst(rank: int, world_size: int, stages: tuple[int, ...], tiled_mlp: bool = False,
         tiled_loss: bool = False) -> dict:
    """The tutorial's loop, for each ZeRO stage: (stage, gradient_accumulation_steps) ->
    losses, final weights, and the reference's (computed untiled); with `tiled_mlp`, the
    loop's model runs ALST's TiledMLP."""
    from shardwise.frontends.deepspeed.alias import install_alias

    install_alias()
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups

    base = tiny_llama()
    data = samples()
    # the sequence group (both ranks) trains rank 0's, then rank 1's sequence of each refill
    order = [0, 1, 2, 3]
    references = {stage: reference(base, order, accumulation=1 if stage == 3 else 2) for stage in stages}

    if tiled_mlp:
        tile_llama_mlp()
    if tiled_loss:
        tile_llama_loss()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=base, core_attn_implementation="sdpa", sequence_parallel_size=2, micro_batch_size=1,
        seq_length=16, seq_length_is_variable=True)
    results = {}
    for stage in stages:
        accumulation = 1 if stage == 3 else 2
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
                  "gradient_clipping": 0.0,  # no clipping, as the reference; DeepSpeed 0.19.8 clips at 1.0 without the key
                  "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": WEIGHT_DECAY}}}
        if stage == 3:  # as the tutorial writes it; without it (as Accelerate writes it), the mpu's size
            config["sequence_parallel_size"] = 2
        model = copy.deepcopy(base)
        engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters(),
                                               mpu=mpu)
        sp_group = groups._get_sequence_parallel_group()
        sp_world_size = groups._get_sequence_parallel_world_size()
        sp_rank = groups._get_sequence_parallel_rank()
        assert dist.get_process_group_ranks(sp_group) == [0, 1] and (sp_world_size, sp_rank) == (2, rank)
        own = torch.utils.data.Subset(data, list(range(rank, len(data), world_size)))
        loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(own, batch_size=1, collate_fn=collate),
                                            sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size,
                                            device=engine.device)
        assert len(loader) == 4
        losses = []
        for batch in loader:
            batch = move_to_device(batch, engine.device)
            outputs = engine(**batch)
            shift_labels = batch["shift_labels"]
            if tiled_loss:
                loss = outputs.loss
            else:
                loss = engine.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                                   vocab_size=engine.module.config.vocab_size)
            losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
            good_tokens = (shift_labels != -100).view(-1).sum()
            good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
            total = sum(losses_per_rank[r] * good_tokens_per_rank[r] for r in range(sp_world_size))
            loss = total / max(sum(good_tokens_per_rank), 1)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
        initial = {name: param.detach().clone() for name, param in base.named_parameters()}
        results[stage] = {"losses": losses, "weights": weights, "initial": initial, "tiles": {kind: len(runs) for kind, runs in tiles_run.items()},
                          "reference_losses": references[stage][0],
                          "reference_weights": references[stage][1]}
        engine.destroy()
        for runs in tiles_run.values():
            runs.clear()
    return results


def _raises(call, kind: type[BaseException]) -> str:
    try:
        call()
    except kind as error:
        return str(error)
    raise AssertionError(f"{call} did not raise {kind.__name__}")


def checks(rank: int, world_size: int) -> dict:
    """register_with_transformers' and the adapter's refusals and behaviour, and what
    deepspeed.initialize refuses, on two ranks (the groups need a world)."""
    from transformers import LlamaConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from shardwise.frontends.deepspeed.api import initialize
    from shardwise.frontends.deepspeed.api.runtime.config import DeepSpeedConfigError
    from shardwise.frontends.deepspeed.api.runtime.sequence_parallel import parallel_state_sp
    from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter)

    said: dict = {}
    register = UlyssesSPAttentionHF.register_with_transformers
    model = tiny_llama()
    said["too_many_ranks"] = _raises(lambda: register(model, "sdpa", 4, 1), RuntimeError)

    def again(*args, **kwargs):
        parallel_state_sp._release_sequence_parallel_groups()
        return register(*args, **kwargs)

    said["eager"] = _raises(lambda: again(tiny_llama_with("eager"), "eager", 2, 1), ValueError)
    said["mismatch"] = _raises(lambda: again(model, "flash_attention_2", 2, 1), ValueError)
    said["unknown"] = _raises(lambda: again(_WithConfig(LlamaConfig()), "no_such_attention", 2, 1), ValueError)
    uneven = _WithConfig(_config(hidden_size=24, num_attention_heads=3, num_key_value_heads=3))
    said["heads"] = _raises(lambda: again(uneven, "sdpa", 2, 1), ValueError)
    said["twice"] = _raises(lambda: register(model, "sdpa", 2, 1), AssertionError)
    said["sdpa_untouched"] = ALL_ATTENTION_FUNCTIONS["sdpa"].__name__
    mpu = again(model, "sdpa", 2, 1)
    said["sdpa_wrapped"] = ALL_ATTENTION_FUNCTIONS["sdpa"].__name__
    said["mpu"] = [mpu is parallel_state_sp, mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank(),
                   mpu.get_sequence_data_parallel_world_size(), mpu.get_model_parallel_world_size(),
                   mpu.sequence_parallel_ranks()]
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    said["config_size"] = _raises(lambda: initialize(model=tiny_llama(), config=config, mpu=mpu), DeepSpeedConfigError)
    said["other_mpu"] = _raises(lambda: initialize(model=tiny_llama(), config=config, mpu=object()), ValueError)

    group = mpu.get_sequence_parallel_group()

    def adapter(rows: list[dict]) -> UlyssesSPDataLoaderAdapter:
        return UlyssesSPDataLoaderAdapter(rows, sp_rank=rank, sp_group=group, sp_world_size=2, device="cpu")

    ids = torch.arange(8).view(1, 8) + 10 * rank
    good = {"input_ids": ids, "labels": ids + 100, "position_ids": torch.arange(8).view(1, 8), "tag": f"rank{rank}"}
    loader = adapter([good, good])
    said["len"] = len(loader)
    said["epochs"] = [[{key: value.tolist() if torch.is_tensor(value) else value for key, value in batch.items()}
                       for batch in loader] for _ in range(2)]
    said["no_position_ids"] = _raises(lambda: next(adapter([{"input_ids": ids, "labels": ids}])), ValueError)
    said["shape"] = _raises(lambda: next(adapter([dict(good, labels=ids[:, :6])])), ValueError)
    odd = torch.arange(7).view(1, 7)
    said["attention"] = attention_calls(rank, group)
    said["odd_length"] = _raises(lambda: next(adapter([{"input_ids": odd, "labels": odd, "position_ids": odd}])),
                                 ValueError)
    return said


def attention_calls(rank: int, group) -> dict:
    """What the core attention receives from UlyssesSPAttentionHF: whole sequences of half
    the heads and the whole sequence's position_ids in training; this rank's shard as it
    came with `disable_in_eval` in eval; and the shape check of a fixed length."""
    from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    seen = []

    def core(module, query, key, value, mask, **kwargs):
        seen.append({"query": list(query.shape), "key": list(key.shape), "mask": mask,
                     "position_ids": kwargs["position_ids"].tolist(), "first": query[0, :, 0, 0].tolist()})
        return query.transpose(1, 2), None

    def wrapped(**options):
        options = {"seq_length_is_variable": True, **options}
        return UlyssesSPAttentionHF(core, batch_size=1, attn_head_count=4, attn_head_size=3, kv_head_count=2,
                                    num_hidden_layers=1, process_group=group, **options)

    module = torch.nn.Module()
    query = torch.arange(4.0).view(1, 4, 1, 1).expand(1, 4, 3, 3) + 10 * rank  # heads 0-3, this rank's 3 positions
    key = value = torch.zeros(1, 2, 3, 3)
    positions = torch.arange(3).view(1, 3) + 3 * rank
    output, _ = wrapped()(module, query, key, value, None, position_ids=positions)
    said = {"training": seen.pop(), "output": list(output.shape)}
    module.eval()
    wrapped(disable_in_eval=True)(module, query, key, value, "mask", position_ids=positions)
    said["eval"] = seen.pop()
    module.train()
    fixed = wrapped(seq_length_is_variable=False, local_seq_length=4, global_seq_length=8)
    said["fixed_length"] = _raises(lambda: fixed(module, query, key, value, None, position_ids=positions), ValueError)
    said["no_local_length"] = _raises(lambda: wrapped(seq_length_is_variable=False), ValueError)
    said["no_positions"] = _raises(lambda: wrapped()(module, query, key, value, None), ValueError)
    return said


class _WithConfig:
    """Stands for a loaded model: register_with_transformers reads its `config` only."""

    def __init__(self, config):
        self.config = config


def _config(**overrides):
    from transformers import LlamaConfig

    config = LlamaConfig(**{"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 1, **overrides})
    config._attn_implementation = "sdpa"
    return config


def tiny_llama_with(implementation: str) -> _WithConfig:
    config = _config()
    config._attn_implementation = implementation
    return _WithConfig(config)


def layout_mismatch(rank: int, world_size: int) -> str:
    """Four ranks, the mpu's sequence groups {0, 1} and {2, 3}, and a config that also asks
    for tensor parallelism of 2 (tensor innermost: the layout's sequence groups are {0, 2}
    and {1, 3}): initialize must refuse rather than average over other ranks."""
    from shardwise.frontends.deepspeed.api import initialize
    from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = tiny_llama(kv_heads=2)  # heads and KV heads that tensor parallelism of 2 can split
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1)
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
              "tensor_parallel": {"autotp_size": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    return _raises(lambda: initialize(model=model, config=config, mpu=mpu), ValueError)
