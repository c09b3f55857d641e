"""A small character-level language model, trained by your own loop under the launcher.

A causal transformer (token and position embeddings, pre-norm blocks of causal
self-attention and an MLP) learns to predict the next character of any UTF-8
text file. The loop is an ordinary PyTorch loop: AdamW, a cosine learning-rate
schedule with linear warm-up, gradient clipping and bf16 autocast on CPU (fp16
with a GradScaler on a GPU). Five lines talk to the launcher's session:
``prepare``, ``register``, ``loader``, ``epochs`` and ``step`` / ``report``, and
with them the run resumes exactly, checkpoints on a preemption notice and
reports its loss and perplexity::

    launcher run --workload examples/char_lm.py:train --data notes.txt --workers 2
    launcher run --workload examples/char_lm.py:train --data notes.txt --backend horovod
    launcher workloads examples/char_lm.py:train      # what it is, its params

The run exports the model as a program; ``predict`` below turns it into text in, text out
for ``launcher predict`` and ``launcher serve``::

    launcher serve --run char_lm_1
    curl -s localhost:8000/predict -d '{"instances": ["def "], "parameters": {"chars": 40}}'

Any text does; Python ships one (its help topics)::

    python -c "import pydoc_data.topics as t; open('topics.txt','w').write(''.join(t.topics.values()))"
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import workloads
from workloads import Param

PARAMS = [
    Param("context", int, 64, "characters the model sees at once"),
    Param("layers", int, 2, "transformer blocks"),
    Param("width", int, 64, "embedding width"),
    Param("heads", int, 4, "attention heads"),
    Param("warmup", float, 0.1, "fraction of the steps spent warming the learning rate up"),
    Param("weight_decay", float, 0.1, "AdamW's weight decay"),
    Param("clip", float, 1.0, "gradient-norm clipping (0: none)"),
    Param("max_chars", int, 0, "read at most this many characters of the file (0: all)"),
]


class Text:
    """The file as character ids; item i is a window of ``context`` characters and the same
    window one character on (inputs, targets)."""

    def __init__(self, path: str, context: int, max_chars: int = 0) -> None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if max_chars:
            text = text[:max_chars]
        if len(text) < 2 * (context + 1):
            raise ValueError(f"{path} holds {len(text)} characters: give at least {2 * (context + 1)}")
        self.vocab = sorted(set(text))
        ids = {ch: i for i, ch in enumerate(self.vocab)}
        self.ids = torch.tensor([ids[ch] for ch in text], dtype=torch.long)
        self.context = context

    def split(self, start: int, stop: int) -> "Windows":
        return Windows(self.ids[start:stop], self.context)


class Windows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor, context: int) -> None:
        self.ids, self.context = ids, context

    def __len__(self) -> int:
        return max(0, (len(self.ids) - 1) // self.context)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.context:(i + 1) * self.context + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))
        # Made here rather than cut from a stored one: the exported program then takes any length.
        mask = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def warmup_cosine(total_steps: int, warmup: float):
    """The learning-rate factor at each step: linear from 0 to 1, then a cosine down to 10 %."""
    ramp = max(1, int(total_steps * warmup))

    def factor(step: int) -> float:
        if step < ramp:
            return (step + 1) / ramp
        done = (step - ramp) / max(1, total_steps - ramp)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    return factor


@workloads.training_function(epochs=2, batch_size=16, lr=3e-3, params=PARAMS, data="a UTF-8 text file",
                             description="character-level causal transformer language model (your own loop)")
def train(session) -> None:
    """A character-level causal transformer language model, trained by its own loop."""
    p = session.params
    text = Text(session.data, p["context"], p["max_chars"])
    cut = int(len(text.ids) * 0.9)  # the last 10 % is held out
    train_set, val_set = text.split(0, cut), text.split(cut, len(text.ids))

    model = CharTransformer(len(text.vocab), p["context"], p["width"], p["layers"], p["heads"])
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2]
    rest = [q for n, q in model.named_parameters() if q.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": p["weight_decay"]},
                                   {"params": rest, "weight_decay": 0.0}], lr=session.lr)
    model, optimizer = session.prepare(model, optimizer)
    loader = session.loader(train_set, batch_size=session.batch_size)
    val_loader = session.loader(val_set, batch_size=64, train=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(session.epochs_total * len(loader), p["warmup"]))
    gpu = session.device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=gpu)
    session.register(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    precision = torch.float16 if gpu else torch.bfloat16

    for _ in session.epochs():
        model.train()
        for x, y in loader:
            with torch.autocast(session.device.type, dtype=precision):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if p["clip"]:
                scaler.unscale_(optimizer)
                session.clip_gradients(model, optimizer, p["clip"])  # after the backend's allreduce
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            session.step(train_loss=loss)
        val_loss = evaluate(model, val_loader, session.device, precision)
        session.report(val_loss=val_loss, perplexity=math.exp(min(val_loss, 50.0)))


@torch.no_grad()
def evaluate(model, loader, device, precision) -> float:
    """Mean next-character loss over this rank's share of the held-out text."""
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        with torch.autocast(device.type, dtype=precision):
            logits = model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / max(1, count)


@functools.lru_cache(maxsize=4)
def _vocabulary(path: str, max_chars: int) -> tuple[str, ...]:
    """The characters of the training text, in the order their ids were given."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return tuple(sorted(set(text[:max_chars] if max_chars else text)))


def predict(model, instances, parameters):
    """The prediction hook: each instance is a prompt, its prediction the next ``chars``
    characters (default 40), picking the likeliest at each step. ``model`` is the exported
    program as a function of a batch of ids; the vocabulary comes from the run's data file."""
    vocab = _vocabulary(model.data, int(model.params.get("max_chars", 0)))
    ids = {ch: i for i, ch in enumerate(vocab)}
    context = int(model.params.get("context", 64))
    chars = parameters.get("chars", 40)
    if not isinstance(chars, int) or not 1 <= chars <= 1000:
        raise ValueError(f"parameters.chars must be a whole number 1..1000, got {chars!r}")
    out = []
    for i, prompt in enumerate(instances):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"instances[{i}] must be a non-empty text prompt")
        unknown = sorted({ch for ch in prompt if ch not in ids})
        if unknown:
            raise ValueError(f"instances[{i}] holds {unknown[0]!r}, which the training text never does")
        seq = [ids[ch] for ch in prompt]
        for _ in range(chars):
            logits = model([seq[-context:]])  # (1, length, vocabulary)
            seq.append(int(logits[0, -1].argmax()))
        out.append("".join(vocab[t] for t in seq[len(prompt):]))
    return out
