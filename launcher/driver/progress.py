"""Progress on the terminal while a run goes: one line per epoch on stderr.

On a terminal an epoch bar (tqdm) shows the remaining time as well; in a pipe
or a log file only the plain lines appear. Nothing here writes to stdout,
which belongs to the final summary (or the --json object).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from launcher.measures import METRIC_KEYS, pick_metrics
from launcher.worker.timing import describe, largest_share


def format_epoch(m: dict[str, Any], epochs: int, elapsed: float) -> str:
    epoch = m.get("epoch")
    # A Ray Train function's reports count as epochs; one reporting more often than the run has
    # epochs (an XGBoost function's callback: every round) has no total to show.
    counted = isinstance(epoch, int) and epoch > epochs
    parts = [f"epoch {epoch}" if counted else f"epoch {epoch}/{epochs}", f"step {m.get('global_step')}"]
    for key, fmt in (("train_loss", "train_loss {:.4f}"), ("loss", "loss {:.4f}"),
                     ("accuracy", "acc {:.4f}")):
        if isinstance(m.get(key), (int, float)):
            parts.append(fmt.format(m[key]))
    # A training function's own metrics, by their names (at most six: a line, not a table).
    others = [(k, v) for k, v in pick_metrics(m).items() if k not in METRIC_KEYS][:6]
    parts += [f"{k} {v:.4g}" for k, v in others]
    if isinstance(m.get("samples_per_s"), (int, float)):
        parts.append(f"{m['samples_per_s']:,.0f} samples/s")
    if largest_share(m) is not None:  # where the time went (the largest share), and the straggler
        parts.append(describe(m))
        if m.get("data_wait_max_fraction", 0) > 1.5 * m.get("data_wait_fraction", 0) + 0.05:
            parts.append(f"rank input wait up to {100 * m['data_wait_max_fraction']:.0f}%")
    elif isinstance(m.get("data_wait_fraction"), (int, float)):
        parts.append(f"input wait {100 * m['data_wait_fraction']:.0f}%"
                     + (f" (slowest rank {100 * m['data_wait_max_fraction']:.0f}%)"
                        if m.get("data_wait_max_fraction", 0) > 1.5 * m["data_wait_fraction"] + 0.01 else ""))
    parts.append(f"elapsed {elapsed:.1f}s")
    return "  ".join(parts)


def format_round(m: dict[str, Any], rounds: int, elapsed: float) -> str:
    """A boosting run's line at a round checkpoint (its one epoch holds every round)."""
    parts = [f"round {m.get('global_step')}/{rounds}"]
    for key, fmt in (("train_loss", "train {:.4f}"), ("loss", "test {:.4f}")):
        if isinstance(m.get(key), (int, float)):
            parts.append(fmt.format(m[key]))
    parts.append(f"elapsed {elapsed:.1f}s")
    return "  ".join(parts)


class Progress:
    def __init__(self, epochs: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.epochs = epochs
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._bar = None

    def note(self, text: str) -> None:
        if self.enabled:
            self._write(text)

    def epoch(self, metrics: dict[str, Any], elapsed: float) -> None:
        if not self.enabled:
            return
        if self._bar is None and self.stream.isatty():
            from tqdm import tqdm

            start = int(metrics.get("epoch", 1)) - 1
            self._bar = tqdm(total=self.epochs, initial=start, unit="epoch", file=self.stream, leave=False)
        self._write(format_epoch(metrics, self.epochs, elapsed))
        if self._bar is not None:
            self._bar.update(1)

    def _write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
