"""A small GPT: a decoder-only transformer language model, data parallel or sharded.

The same training function runs with every worker holding the whole model (``--strategy
ddp``, the default) or with the model, its gradients and AdamW's moments split over the
workers by torch's FSDP2 (``--strategy fsdp``): ``session.prepare(model, optimizer,
blocks=[Block])`` shards each transformer block on its own, so a forward pass gathers one
block's weights at a time. With the defaults (d_model 512, 8 layers: about 25 M parameters,
~400 MB of weights, gradients and moments in fp32) the saving is plain in the ``state_mb``
metric, this worker's bytes of that state::

    launcher run --workload examples/gpt.py:train --workers 2                     # ddp
    launcher run --workload examples/gpt.py:train --workers 2 --strategy fsdp     # sharded
    launcher run --workload examples/gpt.py:train --param d_model=64 --param layers=2   # seconds

It learns to predict the next character of Python's own help topics (text that ships with
Python, read through :class:`char_lm.Text`), or of any UTF-8 file given with ``--data``.
Besides the losses it reports, per worker: ``state_mb`` (parameters, gradients and optimizer
state after the first step; the session adds each worker's peak RSS), ``step_ms`` (the median
step) and, with ``--checkpoint-every-steps``, ``checkpoint_stall_ms``: the training time a step
checkpoint costs (``launcher bench sharding`` compares these across strategies and upload modes).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import workloads
from char_lm import Text, warmup_cosine  # beside this file: its text windows and LR schedule
from workloads import Param

PARAMS = [
    Param("d_model", int, 512, "embedding width"),
    Param("layers", int, 8, "transformer blocks"),
    Param("heads", int, 8, "attention heads (a divisor of d_model)"),
    Param("context", int, 128, "characters the model sees at once"),
    Param("warmup", float, 0.1, "fraction of the steps spent warming the learning rate up"),
    Param("weight_decay", float, 0.1, "AdamW's weight decay"),
    Param("clip", float, 1.0, "gradient-norm clipping (0: none)"),
    Param("max_chars", int, 0, "read at most this many characters of the text (0: all)"),
    Param("eval_batches", int, 8, "held-out batches each worker scores per epoch (0: its whole share once)"),
]


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention, then an MLP, each added to the residual.
    A class of its own so that ``prepare(..., blocks=[Block])`` names the unit FSDP2 shards."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and the output layer
    (not tied to the token embedding, so each block and the rest shard independently)."""

    def __init__(self, vocab: int, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d_model), nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)
        for module in self.modules():  # GPT-2's initialisation: small weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def load_text(path: str | None, context: int, max_chars: int) -> Text:
    """``--data``'s text, else Python's help topics (``pydoc_data``, shipped with Python)."""
    if path:
        return Text(path, context, max_chars)
    import pydoc_data.topics

    with tempfile.TemporaryDirectory(prefix="gpt-text-") as folder:  # Text reads a file; each rank its own
        topics = os.path.join(folder, "topics.txt")
        with open(topics, "w", encoding="utf-8") as f:
            f.write("".join(pydoc_data.topics.topics.values()))
        return Text(topics, context, max_chars)


class StepClock:
    """Each training step's wall time, plain steps apart from those that took a step checkpoint,
    so that a checkpoint's cost to training is the checkpoint steps' mean over the plain median."""

    def __init__(self, every: int) -> None:
        self.every, self.plain, self.checkpointed = every, [], []
        self.last = time.perf_counter()

    def restart(self) -> None:
        """A step starts now (after evaluation, which is no step's time)."""
        self.last = time.perf_counter()

    def tick(self, global_step: int, epoch_ends: bool) -> None:
        """After ``session.step()``: it checkpointed every ``every`` steps but at the epoch's end."""
        now = time.perf_counter()
        took = now - self.last
        checkpointed = bool(self.every) and global_step % self.every == 0 and not epoch_ends
        (self.checkpointed if checkpointed else self.plain).append(took)
        self.last = now

    def metrics(self) -> dict[str, float]:
        if not self.plain:
            return {}
        base = statistics.median(self.plain)
        out = {"step_ms": 1000 * base}
        if self.checkpointed:
            out["checkpoint_stall_ms"] = 1000 * (statistics.mean(self.checkpointed) - base)
        return out


@workloads.training_function(epochs=1, batch_size=16, lr=1e-3, params=PARAMS,
                             description="GPT-style decoder-only character language model (--strategy ddp or fsdp)")
def train(session) -> None:
    """A GPT-style character language model whose blocks FSDP2 shards under --strategy fsdp."""
    from launcher.worker.sharded import state_bytes

    p = session.params
    if p["d_model"] % p["heads"]:
        raise ValueError(f"d_model {p['d_model']} is not a multiple of heads {p['heads']}: choose, e.g., heads 4")
    text = load_text(session.data, p["context"], p["max_chars"])
    cut = int(len(text.ids) * 0.9)  # the last 10 % is held out
    train_set, val_set = text.split(0, cut), text.split(cut, len(text.ids))
    if len(val_set) < session.world_size:
        raise ValueError(f"the held-out text has {len(val_set)} windows for {session.world_size} workers: "
                         "raise max_chars (or give a longer --data)")

    model = GPT(len(text.vocab), p["context"], p["d_model"], p["layers"], p["heads"])
    decay = [q for q in model.parameters() if q.dim() >= 2]
    rest = [q for q in model.parameters() if q.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": p["weight_decay"]},
                                   {"params": rest, "weight_decay": 0.0}], lr=session.lr)
    model, optimizer = session.prepare(model, optimizer, blocks=[Block])  # ddp ignores blocks
    loader = session.loader(train_set, batch_size=session.batch_size)
    val_loader = session.loader(val_set, batch_size=session.batch_size, train=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(session.epochs_total * len(loader), p["warmup"]))
    scaler = session.grad_scaler()  # enabled for --precision fp16 only
    session.register(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)

    state, clock = None, StepClock(session.spec.checkpoint_every_steps or 0)
    for _ in session.epochs():
        model.train()
        clock.restart()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            with session.autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            scaler.scale(loss).backward()
            if p["clip"]:
                scaler.unscale_(optimizer)
                session.clip_gradients(model, optimizer, p["clip"])
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if state is None:  # gradients and moments exist now, until the next zero_grad
                state = state_bytes(model, optimizer)
            session.step(train_loss=loss)
            clock.tick(session.global_step, session.step_in_epoch == len(loader))
        val_loss, scored = evaluate(session, model, val_loader, p["eval_batches"] or len(val_loader))
        # each rank's loss weighs as many characters as it scored: the mean over all of them
        session.report(weight=scored, val_loss=val_loss, perplexity=math.exp(min(val_loss, 50.0)))
        mb = {"state_mb": state["total"] / 2**20} if state is not None else {}  # none if resumed at the end
        session.report(**mb, **clock.metrics())


@torch.no_grad()
def evaluate(session, model, loader, batches: int) -> tuple[float, int]:
    """Mean next-character loss over exactly ``batches`` batches of this rank's share of the
    held-out text (round it again where it is shorter): under fsdp each forward pass gathers
    the weights from every rank, so every rank must make the same number of them."""
    model.eval()
    total, count = 0.0, 0
    for _, (x, y) in zip(range(batches), _round(loader)):
        with session.autocast():
            logits = model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / max(1, count), count


def _round(loader):
    """The loader's batches over and over (it has at least one: a share per rank was checked)."""
    while True:
        yield from loader
