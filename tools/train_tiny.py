"""Train kestrel's bundled model, models/k3.1-tiny, from scratch on two CPU cores, and write its folder.

    .venv/bin/python tools/train_tiny.py [--out models/k3.1-tiny] [--work .cache/train_tiny]

Rerunning resumes from the last checkpoint in --work (every 100 steps); a finished run only re-exports. Batches
depend only on the seed and the step, so a resumed run trains exactly like an uninterrupted one.

Recipe (architecture in tiny_config.py, data in tiny_data.py):
1. Dense pre-training: next-token loss plus 0.3 x the MTP layer's loss (DeepSeek-V3's weight), attention dense.
2. Indexer warm-up (DeepSeek-V3.2's dense warm-up stage): everything but the indexers frozen; each indexer learns
   to match its layer's dense attention (the heads' mean distribution) by KL divergence.
3. Sparse training: each indexer's top-k selection is active. The model learns from the language-model losses only;
   each indexer from its KL to the attention over the keys it selected only (its gradient kept off the model's,
   as V3.2 detaches the indexer's input).
4. The last part of sparse training is quantization-aware: routed experts run through MXFP4 fake quantization
   (straight-through gradients); at export they are quantized to MXFP4 exactly as trained.
The router's selection bias is updated without an auxiliary loss (DeepSeek-V3): experts above the mean load get
their bias lowered, those below raised. AdamW, linear warm-up, cosine decay, gradient clipping.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from tqdm import tqdm

from corpus import load_corpus
from kestrel import ops
from kestrel.config import parse_config
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.moe import RoutedExperts, Router
from kestrel.models.checkpoint import build_model
from kestrel.models.init import init_weights
from kestrel.models.kimi import KimiForCausalLM
from kestrel.quant.mxfp4 import fake_quantize_mxfp4
from tiny_config import INDEX_TOPK, SEQ_LEN, VOCAB_SIZE, tiny_config
from tiny_data import TrainingData, eval_windows
from tiny_eval import DENSE, AttentionRecord, heldout_loss, indexed_layers, indexer_topk, record_attention
from tiny_export import export
from tiny_tokenizer import special_ids, train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DENSE_PHASE, WARMUP_PHASE, SPARSE_PHASE = "dense", "indexer-warmup", "sparse"


@dataclass(frozen=True)
class Recipe:
    """Every setting of a training run (stored in checkpoints and the model card)."""

    seed: int = 0
    steps: int = 1600
    batch_size: int = 16
    seq_len: int = SEQ_LEN
    vocab_size: int = VOCAB_SIZE
    lr: float = 2e-3
    final_lr_ratio: float = 0.1
    warmup_steps: int = 80
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    chat_fraction: float = 0.1
    indexer_warmup_start: int = 960
    indexer_warmup_steps: int = 96
    indexer_lr: float = 1e-3
    qat_start: int = 1440
    router_bias_speed: float = 1e-2
    eval_every: int = 200
    eval_windows: int = 32
    checkpoint_every: int = 100

    def phase(self, step: int) -> str:
        if step < self.indexer_warmup_start:
            return DENSE_PHASE
        return WARMUP_PHASE if step < self.indexer_warmup_start + self.indexer_warmup_steps else SPARSE_PHASE

    def lr_at(self, step: int) -> float:
        """Linear warm-up to lr, then cosine decay to lr * final_lr_ratio at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps)
        return self.lr * (self.final_lr_ratio + (1 - self.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class FakeQuantMXFP4(nn.Module):
    """A parametrization of a routed-expert weight: MXFP4 fake quantization while `enabled`, identity otherwise."""

    def __init__(self):
        super().__init__()
        self.enabled = False

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quantize_mxfp4(weight) if self.enabled else weight


def new_model(special: dict[str, int], seed: int) -> KimiForCausalLM:
    """The fp32 model to train, initialised from the seed, its routed experts parametrized for QAT."""
    model = init_weights(build_model(parse_config(tiny_config(special, mxfp4=False)), torch.float32), seed=seed)
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            for name in ("w1", "w3", "w2"):
                parametrize.register_parametrization(module, name, FakeQuantMXFP4())
    return model.train()


def strip_qat(model: KimiForCausalLM) -> KimiForCausalLM:
    """Remove the QAT parametrizations, leaving the raw (unquantized) expert weights in place."""
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            for name in ("w1", "w3", "w2"):
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)
    return model


class Trainer:
    """One training run's model, optimizers and router-load bookkeeping."""

    def __init__(self, model: KimiForCausalLM, recipe: Recipe):
        self.model, self.recipe = model, recipe
        indexer_ids = {id(p) for layer in indexed_layers(model) for p in layer.indexer.parameters()}
        self.indexer_params = [p for p in model.parameters() if id(p) in indexer_ids]
        self.main_params = [p for p in model.parameters() if id(p) not in indexer_ids and p.requires_grad]
        decay = [p for p in self.main_params if p.dim() >= 2]
        no_decay = [p for p in self.main_params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)
        self.indexer_optimizer = torch.optim.AdamW(self.indexer_params, lr=recipe.indexer_lr, betas=(0.9, 0.95),
                                                   weight_decay=0.0)
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.loads = [torch.zeros(r.weight.shape[0]) for r in self.routers]
        for router, load in zip(self.routers, self.loads):
            router.register_forward_hook(partial(_count_load, load=load))

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "indexer_optimizer": self.indexer_optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.indexer_optimizer.load_state_dict(state["indexer_optimizer"])

    def step(self, step: int, windows: torch.Tensor) -> dict[str, float]:
        """One optimizer step on windows [B, T + 1]; returns its losses."""
        phase = self.recipe.phase(step)
        for p in self.main_params:
            p.requires_grad_(phase != WARMUP_PHASE)
        for module in self.model.modules():
            if isinstance(module, FakeQuantMXFP4):
                module.enabled = step >= self.recipe.qat_start
        for load in self.loads:
            load.zero_()
        topk = INDEX_TOPK if phase == SPARSE_PHASE else DENSE
        recording = record_attention(self.model) if phase != DENSE_PHASE else nullcontext([])
        with indexer_topk(self.model, topk), recording as records:
            hidden = self._forward(windows)
        if phase == WARMUP_PHASE:
            return self._indexer_step(hidden, windows, records, topk)
        lm, mtp = self._lm_losses(hidden, windows)
        losses = {"loss": lm.item(), "mtp_loss": mtp.item()}
        indexer_grads = None
        if phase == SPARSE_PHASE:
            kl = indexer_kl(records, topk)
            indexer_grads = torch.autograd.grad(kl, self.indexer_params, retain_graph=True)
            losses["indexer_kl"] = kl.item()
        (lm + self.recipe.mtp_weight * mtp).backward()
        self._apply(self.optimizer, self.main_params, self.recipe.lr_at(step))
        if indexer_grads is not None:
            for p, g in zip(self.indexer_params, indexer_grads):
                p.grad = g
            self._apply(self.indexer_optimizer, self.indexer_params, self.recipe.indexer_lr)
        self._update_router_bias()
        return losses

    def _forward(self, windows: torch.Tensor) -> torch.Tensor:
        """Hidden states [B * T, D] of the windows' first T tokens, packed as B sequences."""
        size, length = windows.shape[0], windows.shape[1] - 1
        return self.model(windows[:, :-1].reshape(-1), ForwardBatch.build([length] * size))

    def _lm_losses(self, hidden: torch.Tensor, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token and MTP (token after next) cross-entropies of the packed windows' hidden states."""
        size, length = windows.shape[0], windows.shape[1] - 1
        lm = F.cross_entropy(self.model.compute_logits(hidden), windows[:, 1:].reshape(-1))
        drafts = hidden.view(size, length, -1)[:, :-1].reshape(-1, hidden.shape[-1])
        logits = self.model.mtp_logits(drafts, windows[:, 1:-1].reshape(-1), ForwardBatch.build([length - 1] * size))
        return lm, F.cross_entropy(logits, windows[:, 2:].reshape(-1))

    def _indexer_step(self, hidden: torch.Tensor, windows: torch.Tensor, records: list[list[AttentionRecord]],
                      topk: int) -> dict[str, float]:
        """Indexer warm-up: the model is frozen; only the indexers learn, from the KL to dense attention."""
        with torch.no_grad():
            lm, mtp = self._lm_losses(hidden, windows)
        kl = indexer_kl(records, topk)
        kl.backward()
        self._apply(self.indexer_optimizer, self.indexer_params, self.recipe.indexer_lr)
        return {"loss": lm.item(), "mtp_loss": mtp.item(), "indexer_kl": kl.item()}

    def _apply(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], lr: float) -> None:
        torch.nn.utils.clip_grad_norm_(params, self.recipe.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def _update_router_bias(self) -> None:
        """Auxiliary-loss-free balancing: bias += speed * sign(mean load - load) per expert."""
        for router, load in zip(self.routers, self.loads):
            router.e_score_correction_bias.add_(self.recipe.router_bias_speed * torch.sign(load.mean() - load))


def _count_load(router: Router, args: tuple, out: tuple[torch.Tensor, torch.Tensor], load: torch.Tensor) -> None:
    """Forward hook of a router: add the tokens routed to each expert to `load`."""
    load.add_(torch.bincount(out[0].flatten(), minlength=load.numel()).float())


def indexer_kl(records: list[list[AttentionRecord]], topk: int) -> torch.Tensor:
    """Mean over indexed layers and queries of KL(attention || softmax(index scores)) over the keys the layer
    attended: all causal keys in the warm-up, the indexer's top-k in sparse training. The attention is a target."""
    total = torch.zeros(())
    for layer_records in records:
        record = layer_records[0]
        allowed = torch.isfinite(record.scores)
        attended = allowed if topk == DENSE else ops.topk_mask(record.scores.detach(), allowed, topk)
        log_q = torch.log_softmax(record.scores.masked_fill(~attended, float("-inf")), -1).masked_fill(~attended, 0)
        p = record.attention
        kl = (p * (p.clamp_min(1e-30).log() - log_q)).sum(-1)
        total = total + kl[attended.any(-1)].mean()
    return total / len(records)


class RunLog:
    """The loss log (JSON lines in the work folder): one line per step, plus held-out loss lines."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines() if path.is_file() else []
        kept = [line for line in lines if json.loads(line)["step"] < resume_step]
        path.write_text("".join(line + "\n" for line in kept))

    def write(self, entry: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")


def held_out_subset(windows: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """count windows evenly spread over the held-out windows (full-length ones only)."""
    full = [w for w in windows if len(w) == len(windows[0])]
    return [full[i * len(full) // count] for i in range(count)]


def train(recipe: Recipe, out: Path, work: Path) -> None:
    torch.manual_seed(recipe.seed)
    corpus = load_corpus(ROOT / ".cache" / "corpus")
    tokenizer = train_tokenizer((w.text for w in corpus.train), recipe.vocab_size)
    special = special_ids(tokenizer)
    data = TrainingData(corpus.train, tokenizer, recipe.seq_len, recipe.chat_fraction, recipe.seed)
    held_out = [w for work_ in corpus.held_out for w in eval_windows(work_.text, tokenizer, recipe.seq_len)]
    validation = held_out_subset(held_out, recipe.eval_windows)
    trainer = Trainer(new_model(special, recipe.seed), recipe)
    start, clock = _resume(trainer, recipe, work)
    log = RunLog(work / "log.jsonl", start)
    tokens_per_step = recipe.batch_size * recipe.seq_len
    bar = tqdm(total=recipe.steps, initial=start, unit="step", dynamic_ncols=True)
    rate = None
    for step in range(start, recipe.steps):
        began, began_cpu = time.perf_counter(), time.process_time()
        losses = trainer.step(step, data.batch(step, recipe.batch_size))
        seconds = time.perf_counter() - began
        rate = tokens_per_step / seconds if rate is None else 0.9 * rate + 0.1 * tokens_per_step / seconds
        bar.set_postfix(phase=recipe.phase(step), loss=f"{losses['loss']:.3f}", tok_s=f"{rate:.0f}")
        bar.update()
        done = step + 1
        if done % recipe.eval_every == 0 or done == recipe.steps:
            log.write({"step": step, "val_loss": _validation_loss(trainer.model, validation, recipe.phase(step))})
        clock = {"wall_s": clock["wall_s"] + time.perf_counter() - began,
                 "cpu_s": clock["cpu_s"] + time.process_time() - began_cpu}
        log.write({"step": step, "phase": recipe.phase(step), "lr": recipe.lr_at(step), **losses,
                   "tokens_per_s": tokens_per_step / seconds, **clock})
        if done % recipe.checkpoint_every == 0 or done == recipe.steps:
            _save(trainer, recipe, work, done, clock)
    bar.close()
    model = strip_qat(trainer.model).eval()
    stats = {"training_seconds": clock["wall_s"], "training_cpu_seconds": clock["cpu_s"],
             "training_tokens": recipe.steps * tokens_per_step, "corpus_tokens": data.num_tokens}
    export(model, tokenizer, corpus, asdict(recipe), stats, held_out, work / "log.jsonl", out)


def _validation_loss(model: KimiForCausalLM, windows: list[torch.Tensor], phase: str) -> float:
    with indexer_topk(model, INDEX_TOPK if phase == SPARSE_PHASE else DENSE):
        return heldout_loss(model, windows)


def _resume(trainer: Trainer, recipe: Recipe, work: Path) -> tuple[int, dict[str, float]]:
    """(first step to run, {"wall_s", "cpu_s"} of training so far) after loading the work folder's checkpoint."""
    path = work / "checkpoint.pt"
    if not path.is_file():
        return 0, {"wall_s": 0.0, "cpu_s": 0.0}
    state = torch.load(path, weights_only=False)
    if state["recipe"] != asdict(recipe):
        raise SystemExit(f"{path} was written by a different recipe; move it away to start afresh.")
    trainer.load_state_dict(state["trainer"])
    return state["step"], state["clock"]


def _save(trainer: Trainer, recipe: Recipe, work: Path, step: int, clock: dict[str, float]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    partial = work / "checkpoint.pt.partial"
    torch.save({"recipe": asdict(recipe), "step": step, "clock": clock, "trainer": trainer.state_dict()}, partial)
    partial.replace(work / "checkpoint.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "k3.1-tiny", help="model folder to write")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "train_tiny",
                        help="checkpoints and the loss log")
    parser.add_argument("--steps", type=int, default=Recipe.steps, help="training steps (a shorter trial run)")
    args = parser.parse_args()
    recipe = Recipe()
    if args.steps != recipe.steps:
        scale = args.steps / recipe.steps
        recipe = Recipe(steps=args.steps, warmup_steps=max(1, int(recipe.warmup_steps * scale)),
                        indexer_warmup_start=int(recipe.indexer_warmup_start * scale),
                        indexer_warmup_steps=max(1, int(recipe.indexer_warmup_steps * scale)),
                        qat_start=int(recipe.qat_start * scale),
                        eval_every=max(1, int(recipe.eval_every * scale)),
                        checkpoint_every=max(1, int(recipe.checkpoint_every * scale)))
    train(recipe, args.out, args.work)


if __name__ == "__main__":
    main()
