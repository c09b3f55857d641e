"""One preflight check's outcome: ok, a warning or a failure, what it found and the change that fixes it."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    status: str  # ok | warn | FAIL
    what: str
    fix: str = ""

    def line(self) -> str:
        return f"  {self.status:<4}  {self.what}" + (f"\n        -> {self.fix}" if self.fix else "")
