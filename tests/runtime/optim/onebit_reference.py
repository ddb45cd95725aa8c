"""A single-process simulation of 1-bit Adam and 1-bit LAMB with N workers: the reference
the distributed runs must equal (tests/runtime/optim/test_onebit.py).

Written from the algorithms (Tang et al. 2021; Li et al. 2021) with plain tensor
operations and lists of per-worker tensors, sharing no code with shardwise's optimizers
or its compressed collective: the same data per worker, the same flat layout (parameters
in the order the engine lays them out, padded to a multiple of 8·N), the same chunking
(N chunks, worker j the server of chunk j) and the same compression (sign, one scale
||chunk||/√len per chunk, error feedback on both sides).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tests.runtime.zero.workers import build_model, global_batch, model_loss


@dataclass
class OneBitSettings:
    algorithm: str  # "adam" | "lamb"
    lr: float = 1e-2
    freeze_step: int = 2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True
    clipping: float = 0.0
    rows: int = 2  # per worker and micro-batch
    accumulation: int = 1  # micro-batches per step
    bf16: bool = False  # the engine's compute dtype (the simulation is fp32 only)
    stage: int = 0  # the engine's ZeRO stage (decides the momentum's layout)
    grad_accum_fp32: bool = False  # data_types.grad_accum_dtype fp32 (beside bf16)
    extra: dict = field(default_factory=dict)  # 1-bit LAMB's bounds, when not the defaults

    def optimizer_block(self) -> dict:
        params = {"lr": self.lr, "freeze_step": self.freeze_step, "betas": list(self.betas), "eps": self.eps,
                  "weight_decay": self.weight_decay, "bias_correction": self.bias_correction, **self.extra}
        return {"type": "OneBitAdam" if self.algorithm == "adam" else "OneBitLamb", "params": params}

    def lamb(self, key: str) -> float:
        defaults = {"max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0,
                    "factor_min": 0.5, "factor_threshold": 0.1}
        return self.extra.get(key, defaults[key])


def compress(rows: torch.Tensor) -> torch.Tensor:
    """Each row as sign × ||row|| / √len (sign of 0: +)."""
    scale = torch.linalg.vector_norm(rows, dim=-1, keepdim=True) / math.sqrt(rows.shape[-1])
    return torch.where(rows >= 0, scale, -scale)


class Exchange:
    """Workers' and servers' error buffers, and the compressed average of N vectors."""

    def __init__(self, workers: int, length: int):
        self.n, self.chunk = workers, length // workers
        self.worker_errors = [torch.zeros(length) for _ in range(workers)]
        self.server_errors = [torch.zeros(self.chunk) for _ in range(workers)]

    def average(self, vectors: list[torch.Tensor]) -> torch.Tensor:
        sent = []
        for i, vector in enumerate(vectors):
            compensated = self.worker_errors[i] + vector
            quantised = compress(compensated.view(self.n, self.chunk))
            self.worker_errors[i] = compensated - quantised.view(-1)
            sent.append(quantised)
        pieces = []
        for j in range(self.n):
            average = sent[0][j].clone()
            for i in range(1, self.n):  # in sender order
                average += sent[i][j]
            average /= self.n
            compensated = self.server_errors[j] + average
            quantised = compress(compensated.view(1, self.chunk)).view(-1)
            self.server_errors[j] = compensated - quantised
            pieces.append(quantised)
        return torch.cat(pieces)


Units = list[tuple[int, list[tuple[str, int]]]]  # per unit: padded length, (parameter name, offset)


class Simulation:
    """N workers training one model with 1-bit Adam / LAMB; `order` is the engine's layout
    of parameters by name, `units` its flat buffers, whose norms the engine sums for
    gradient clipping (in fp32, one per buffer: the same rounding here).

    The momentum's flat layout (which decides the exchange's chunks) is the engine's:
    stage 0, the parameters back to back in `order`, padded at the end to a multiple of
    8·N, the padding left as the exchange returned it; stages 1-2, N rows, row r rank r's
    ZeRO partition (chunk r of every unit, unit padding included, padded to whole bytes),
    every element folded with β1 (zero/onebit_momentum.py)."""

    def __init__(self, settings: OneBitSettings, workers: int, order: list[str], units: Units,
                 model_kind: str = "gpt"):
        self.s, self.n, self.kind, self.units = settings, workers, model_kind, units
        self.model = build_model(model_kind)
        named = dict(self.model.named_parameters())
        self.names = order
        self.params = [named[name] for name in order]
        self.numel = sum(p.numel() for p in self.params)
        self.positions, self.length = self._layout(settings.stage)
        self.pieces = self._pieces(settings.stage)
        self.flat_m: torch.Tensor | None = None
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.v_fresh: list[torch.Tensor] = []
        self.coeff = [0.0] * len(self.params)
        self.last_factor = [1.0] * len(self.params)
        self.exchange = Exchange(workers, self.length)
        self.t = 0

    def _layout(self, stage: int) -> tuple[list[torch.Tensor], int]:
        """Each parameter's element positions in the flat momentum, and its length."""
        if stage == 0:
            unit = 8 * self.n
            sizes = [p.numel() for p in self.params]
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            return [torch.arange(a, a + size) for a, size in zip(starts, sizes)], math.ceil(self.numel / unit) * unit
        columns, by_name = 0, {}
        widths = [padded // self.n for padded, _ in self.units]
        partition = math.ceil(sum(widths) / 8) * 8
        for (padded, slots), width in zip(self.units, widths):
            for name, offset in slots:
                elements = torch.arange(offset, offset + dict(zip(self.names, self.params))[name].numel())
                by_name[name] = (elements // width) * partition + columns + elements % width
            columns += width
        return [by_name[name] for name in self.names], self.n * partition

    def _pieces(self, stage: int) -> list[list[tuple[int, int]]]:
        """Per parameter, the element ranges the engine's ranks hold (stage 0: the whole)."""
        if stage == 0:
            return [[(0, p.numel())] for p in self.params]
        by_name = {}
        for padded, slots in self.units:
            width = padded // self.n
            for name, offset in slots:
                numel = dict(zip(self.names, self.params))[name].numel()
                inner = (r * width - offset for r in range(self.n))
                cuts = sorted({0, numel, *(cut for cut in inner if 0 < cut < numel)})
                by_name[name] = list(zip(cuts[:-1], cuts[1:]))
        return [by_name[name] for name in self.names]

    def _norm(self, k: int, tensor: torch.Tensor) -> float:
        """Parameter k's norm as the engine forms it: each rank's piece's fp32 norm, their
        squares summed in float64 (a whole parameter: its fp32 norm)."""
        flat = tensor.reshape(-1)
        return math.sqrt(sum(torch.linalg.vector_norm(flat[a:b]).double().square().item()
                             for a, b in self.pieces[k]))

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.length)
        for positions, tensor in zip(self.positions, tensors):
            flat[positions] = tensor.reshape(-1)
        return flat

    def local_gradients(self, step: int) -> tuple[list[list[torch.Tensor]], float]:
        """Per worker, its micro-batch's gradients; and the mean of the workers' losses."""
        x, y = global_batch(step, self.s.rows * self.n * self.s.accumulation)
        gradients, losses = [], []
        for worker in range(self.n):
            self.model.zero_grad()
            for micro in range(self.s.accumulation):  # the engine's layout: micro-major, then rank
                start = (micro * self.n + worker) * self.s.rows
                loss = model_loss(self.model, self.kind, x[start : start + self.s.rows], y[start : start + self.s.rows])
                (loss / self.s.accumulation).backward()
                losses.append(loss.item())
            gradients.append([p.grad.detach().clone() for p in self.params])
        return gradients, sum(losses) / len(losses)

    def norm_squared(self, gradients: list[torch.Tensor]) -> float:
        by_name = dict(zip(self.names, gradients))
        norms = []
        for padded, slots in self.units:
            flat = torch.zeros(padded)
            for name, offset in slots:
                flat[offset : offset + by_name[name].numel()] = by_name[name].reshape(-1)
            norms.append(torch.linalg.vector_norm(flat, dtype=torch.float32))
        return torch.stack(norms).square().sum().double().item()

    def clip(self, gradients: list[torch.Tensor], norm: float) -> list[torch.Tensor]:
        if self.s.clipping <= 0:
            return gradients
        coefficient = min(1.0, self.s.clipping / (norm + 1e-6))
        return gradients if coefficient == 1.0 else [g.mul(coefficient) for g in gradients]

    def train(self, steps: range) -> list[float]:
        """Losses of `steps`, with one thread as each rank has (matmuls split over threads
        round differently, and a sign compressor turns last-bit differences into flips)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._train(steps)
        finally:
            torch.set_num_threads(threads)

    @torch.no_grad()
    def _train(self, steps: range) -> list[float]:
        losses = []
        for step in steps:
            with torch.enable_grad():
                gradients, loss = self.local_gradients(step)
            losses.append(loss)
            self.t += 1
            if self.t <= self.s.freeze_step:
                average = [sum(g[k] / self.n for g in gradients) for k in range(len(self.params))]
                norm = math.sqrt(self.norm_squared(average))
                self.warm_up(self.clip(average, norm))
            else:
                norm = math.sqrt(sum(self.norm_squared(worker) / self.n for worker in gradients))
                self.compressed([self.clip(worker, norm) for worker in gradients])
        return losses

    def step_size(self) -> float:
        if not self.s.bias_correction:
            return self.s.lr
        beta1, beta2 = self.s.betas
        return self.s.lr * math.sqrt(1 - beta2 ** min(self.t, self.s.freeze_step)) / (1 - beta1**self.t)

    def warm_up(self, gradients: list[torch.Tensor]) -> None:
        beta1, beta2 = self.s.betas
        for k, (p, g) in enumerate(zip(self.params, gradients)):
            self.m[k].mul_(beta1).add_(g, alpha=1 - beta1)
            self.v[k].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = self.m[k] / self.v[k].sqrt().add_(self.s.eps)
            if self.s.weight_decay:
                update.add_(p, alpha=self.s.weight_decay)
            ratio = 1.0
            if self.s.algorithm == "lamb":
                ratio = _trust_ratio(self._norm(k, p), self._norm(k, update), self.s)
                self.coeff[k] = self.s.lamb("coeff_beta") * self.coeff[k] + (1 - self.s.lamb("coeff_beta")) * ratio
            p.add_(update, alpha=-self.step_size() * ratio)

    def compressed(self, gradients: list[list[torch.Tensor]]) -> None:
        beta1, beta2 = self.s.betas
        previous = [m.clone() for m in self.m]
        if self.n > 1:
            if self.flat_m is None:
                self.flat_m = self.flatten(self.m)
            padding = self.flat_m.clone()  # stage 0 leaves the padding's momentum as it is
            if self.s.stage > 0:
                padding.mul_(beta1)
            flats = []
            for worker in gradients:
                flat = self.flat_m.mul(beta1).add_(self.flatten(worker), alpha=1 - beta1)
                mask = torch.ones(self.length, dtype=torch.bool)
                mask[torch.cat(self.positions)] = False
                flat[mask] = padding[mask]
                flats.append(flat)
            self.flat_m = self.exchange.average(flats)
            self.m = [self.flat_m[positions].view_as(p).clone() for positions, p in zip(self.positions, self.params)]
        else:
            self.m = [m.mul(beta1).add_(g, alpha=1 - beta1) for m, g in zip(self.m, gradients[0])]
        if self.s.algorithm == "lamb" and not self.v_fresh:
            self.v_fresh = [v.clone() for v in self.v]
        for k, p in enumerate(self.params):
            denominator = self.v[k].sqrt().add_(self.s.eps)
            preliminary = self.m[k] / denominator
            update = preliminary.add(p, alpha=self.s.weight_decay) if self.s.weight_decay else preliminary
            scale = 1.0
            if self.s.algorithm == "lamb":
                gradient = (self.m[k] - beta1 * previous[k]) / (1 - beta1)
                self.v_fresh[k].mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
                factor = (denominator / self.v_fresh[k].sqrt().add_(self.s.eps)).max().item()
                if self.s.weight_decay:
                    share = min(1.0, self._norm(k, preliminary) / self._norm(k, update))
                    factor = factor * share + (1 - share)
                factor = min(max(factor, self.s.lamb("factor_min")), self.s.lamb("factor_max"))
                threshold = self.s.lamb("factor_threshold")
                last = self.last_factor[k]
                factor = min(max(factor, last * (1 - threshold)), last * (1 + threshold))
                self.last_factor[k] = factor
                scale = self.coeff[k] * factor
            p.add_(update, alpha=-self.step_size() * scale)

    def adopt(self, state: dict[str, dict], tolerance: float | None) -> None:
        """Continue from the engine's weights and optimizer state (by name), after checking
        that they agree with this simulation's within `tolerance` (relative; None: a new
        simulation taking over, e.g. at another world size)."""
        for k, (name, p) in enumerate(zip(self.names, self.params)):
            theirs = state[name]
            for mine, key in ((p, "weight"), (self.m[k], "exp_avg"), (self.v[k], "exp_avg_sq")):
                error = ((mine.reshape(-1) - theirs[key]).norm() / theirs[key].norm().clamp_min(1e-30)).item()
                assert tolerance is None or error < tolerance, f"{name} {key}: relative error {error:.2e}"
            with torch.no_grad():
                p.copy_(theirs["weight"].view_as(p))
            self.m[k] = theirs["exp_avg"].view_as(p).clone()
            self.flat_m = None  # rebuilt from the adopted momentum
            self.v[k] = theirs["exp_avg_sq"].view_as(p).clone()
            self.coeff[k] = theirs.get("lamb_coeff_freeze", 0.0)
            self.last_factor[k] = theirs.get("last_factor", 1.0)
            if "exp_avg_sq_fresh" in theirs:
                self.v_fresh = self.v_fresh or [None] * len(self.params)
                self.v_fresh[k] = theirs["exp_avg_sq_fresh"].view_as(p).clone()
        self.t = int(next(iter(state.values()))["step"].item())

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def _trust_ratio(weight_norm: float, update_norm: float, s: OneBitSettings) -> float:
    if weight_norm == 0 or update_norm == 0:
        return 1.0
    return min(max(weight_norm / update_norm, s.lamb("min_coeff")), s.lamb("max_coeff"))
