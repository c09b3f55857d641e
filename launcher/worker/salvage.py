"""The survivors' checkpoint: when a node of the group goes before the checkpoint that would
have covered the step was stored, the lowest surviving rank writes the group's state alone.

:class:`SurvivorsCheckpoint` is a part of :class:`launcher.worker.loop.Session`: at start each
rank learns every rank's Ray node (one all-reduce); after a collective fails, the survivors
look for a node that is draining or dead, and if one is, the lowest surviving rank writes a
checkpoint of where training stands (:meth:`SurvivorsCheckpoint.salvage`). A session that can
write its state without the other ranks says so (``can_salvage``, ``save_alone``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from launcher import _ray
from launcher.storage import Storage
from launcher.storage.checkpoint import MANIFEST

SALVAGE_WAIT_S = 5.0  # after a collective failed: how long to look for the node that went
SALVAGED = "salvaged"  # a checkpoint's metric: written by a survivor alone (see SurvivorsCheckpoint.salvage)


def node_key(node_id: str) -> int:
    """A Ray node id as a number a float64 all-reduce carries exactly: 48 bits of its hash (ids
    need not differ in any given 48 bits: a fake cluster's are f...f00001, f...f00002)."""
    return int(hashlib.sha256(node_id.encode()).hexdigest()[:12], 16)


class SurvivorsCheckpoint:
    """The survivors' checkpoint, as a part of a session (see the module docstring). The session
    provides ``spec``, ``rank``, ``world``, ``notices``, ``pos``, ``saved_step`` and
    ``sum_over_ranks``."""

    rank_nodes: list[int]  # each rank's node (node_key), known after learn_nodes

    def can_salvage(self) -> bool:
        """Whether :meth:`save_alone` can write the group's state as it stands now: a session that
        knows its ranks' nodes, and whose state is that of the step its position counts."""
        return False

    def save_alone(self, directory: str, metrics: dict[str, Any]) -> bool:
        """Write a whole checkpoint of this rank's state into ``directory`` without the other
        ranks (no collective: some are gone), manifest last; False where this session cannot."""
        return False

    def learn_nodes(self) -> None:
        """Each rank's Ray node (one all-reduce, at start), so that after a node is lost the
        survivors can tell whose it was (see :meth:`salvage`)."""
        if self.world < 2 or not self.notices:
            return
        import ray

        keys = np.zeros(self.world, dtype=np.float64)
        keys[self.rank] = node_key(ray.get_runtime_context().get_node_id())
        self.rank_nodes = [int(k) for k in self.sum_over_ranks(keys)]

    def gone_ranks(self, wait_s: float) -> set[int]:
        """The ranks whose node is draining (preempted) or dead, looking for up to ``wait_s``."""
        import ray

        end = time.time() + wait_s
        while True:
            try:
                gone = {node_key(n) for n in (_ray.global_state.get_draining_nodes() or {})}
                gone |= {node_key(n["NodeID"]) for n in ray.nodes() if not n.get("Alive")}
            except Exception:  # noqa: BLE001 - the GCS did not answer: nothing known
                gone = set()
            ranks = {r for r, key in enumerate(self.rank_nodes) if key in gone}
            if ranks or time.time() >= end:
                return ranks
            time.sleep(0.2)

    def lost_peers(self, error: BaseException) -> bool:
        """After ``error`` (a collective failing, say): whether a node of the group has gone
        (draining or dead); if so the survivors' checkpoint is written (:meth:`salvage`).

        The caller then holds rather than raise: Ray Train judges a restart by the errors it
        sees first, and a survivor's "connection reset" reaching it before the death of the
        preempted rank is charged as a failure of the code (with --max-failures 0 the run
        failed: seen in the chaos lab); holding leaves the preempted rank's death as the cause."""
        if not self.rank_nodes:
            return False
        # A collective that lost a peer raises RuntimeError (gloo, NCCL: torch's DistBackendError is
        # one): the node's loss may take a moment to show. Any other error is the code's own.
        gone = self.gone_ranks(SALVAGE_WAIT_S if isinstance(error, RuntimeError) else 0.0)
        if not gone:
            return False
        self.salvage(error, gone)
        return True

    def salvage(self, error: BaseException, gone: set[int]) -> str | None:
        """A checkpoint of where training stands, written by the lowest surviving rank alone,
        when a node of the group went before the checkpoint that would have covered this step
        was stored (GCE reclaimed a VM before the checkpoint its notice asked for could commit,
        or without notice). Data parallel: every survivor holds the same weights and optimizer
        state, and a rank's data position is a function of the step, so one survivor's state is
        the whole group's; the ranks that went lose only their RNG streams (reseeded on resume).

        Only when the state is that of a counted step (no optimizer step since the position was
        last advanced), newer than the last stored checkpoint, and a rank's node is draining or
        dead (a failure of the code itself writes nothing). The checkpoint is a folder of the
        run like any other, its manifest written last, so one cut off is never used. Returns
        its path, or None. ``gone``: the ranks whose node went (:meth:`gone_ranks`)."""
        if not self.can_salvage() or self.pos.global_step <= max(self.saved_step, 0):
            return None
        if not gone or self.rank in gone or self.rank != min(set(range(self.world)) - gone):
            return None
        storage = Storage.resolve(self.spec.storage)
        folder = f"checkpoint_{SALVAGED}_{time.strftime('%Y-%m-%d_%H-%M-%S')}_step{self.pos.global_step}"
        d = tempfile.mkdtemp(prefix="launcher-salvage-")
        try:
            if not self.save_alone(d, {SALVAGED: 1, "lost_ranks": len(gone)}):
                return None
            names = sorted(os.listdir(d), key=lambda n: n == MANIFEST)  # the manifest last
            for name in names:
                with open(os.path.join(d, name), "rb") as f:
                    storage.write_bytes(f.read(), self.spec.name, folder, name)
        except Exception as exc:  # noqa: BLE001 - the last complete checkpoint stands
            print(f"rank {self.rank}: could not write the survivors' checkpoint ({type(exc).__name__}: {exc})",
                  flush=True)
            return None
        finally:
            shutil.rmtree(d, ignore_errors=True)
        print(f"rank {self.rank}: ranks {sorted(gone)} went with their node ({type(error).__name__}); the "
              f"survivors' checkpoint of step {self.pos.global_step} is stored ({folder})", flush=True)
        self.saved_step = self.pos.global_step
        return storage.path(self.spec.name, folder)
