"""Chaos for a trainer package: a preemption notice reaches it as SIGTERM and costs no step;
a crash is restarted within --max-failures (beyond it, the run fails with the rank's status:
tests/test_script.py).

The example package (examples/trainer_package) runs unmodified on the preemption
lab's two worker nodes; it checkpoints to AIP_CHECKPOINT_DIR each epoch and on
SIGTERM, and resumes from there.
"""

from __future__ import annotations

import io
import os
import re
import time

import pytest

from launcher.driver.program import from_package
from launcher.lab.chaos import run_in_background
from launcher.spec import JobSpec

pytestmark = pytest.mark.chaos

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "trainer_package")
PER_EPOCH = 1437 // 64  # the digits' training split, batches of 32 on each of 2 ranks
EPOCHS = 5
TOTAL = PER_EPOCH * EPOCHS


class Run:
    """The package run in the background as `preemption demo` and `bench preemption` run a program
    (launcher.lab.chaos.BackgroundRun), its lines kept."""

    def __init__(self, lab, storage: str, name: str, max_failures: int, *args: str) -> None:
        spec = JobSpec(workers=2, storage=storage, name=name, address=lab.address,
                       max_failures=max_failures).validated()
        self.out = io.StringIO()
        self.job = run_in_background(spec, program=from_package(EXAMPLE, "trainer.task"),
                                     program_args=["--epochs", str(EPOCHS), *args], out=self.out)

    def wait_for(self, text: str, timeout_s: float = 180) -> None:
        end = time.time() + timeout_s
        while text not in self.out.getvalue():
            assert self.job.running and time.time() < end, f"no {text!r}:\n{self.out.getvalue()[-3000:]}"
            time.sleep(0.1)

    def wait(self, timeout_s: float = 400):
        summary = self.job.wait(timeout_s)
        return self.job.exit_code, summary


def test_a_crash_is_restarted_and_a_notice_reaches_the_package_as_sigterm_and_costs_no_step(lab, tmp_path):
    """One run, two restarts (one launch rather than one per restart). Rank 1 crashes early in
    epoch 2, once (never after a resume): a failure, restarted within --max-failures 1, both ranks
    resuming from the epoch-1 checkpoint. Then, once the restarted group trains, a node gets a
    notice: the package gets SIGTERM, saves at the step it stands at, and every rank resumes there:
    0 steps lost. The notice is a preemption, not charged to --max-failures (the crash spent it)."""
    run = Run(lab, str(tmp_path), "crash_notice", 1, "--step-sleep", "0.08", "--fail-at-step", str(PER_EPOCH + 3))
    # The restarted group has resumed: the notice comes as far from the run's end as epoch 1's end
    # is in an uncrashed run (4 epochs of 80 ms steps left).
    run.wait_for(f"resumed from step {PER_EPOCH} of {TOTAL}")
    lab.preempt(0)
    code, s = run.wait()
    out = run.out.getvalue()
    assert code == 0 and s.status == "succeeded", out[-3000:]
    assert (s.restarts, s.preemptions, s.preemption_notices) == (2, 1, 1), s
    assert [i.cause for i in s.interruptions] == ["failure", "preemption"], s
    assert s.exit_codes == {"0": 0, "1": 0}, s
    saved = [int(m) for m in re.findall(r"saved checkpoint at step (\d+) \(SIGTERM\)", out)]
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", out)]
    # both ranks resume from the epoch-1 checkpoint after the crash, then at the step saved on
    # SIGTERM: 0 steps lost
    assert len(saved) == 1 and resumed == [PER_EPOCH] * 2 + saved * 2 and PER_EPOCH < saved[0] < TOTAL, out[-3000:]
    assert out.count(f"resumed from step {PER_EPOCH} of {TOTAL}") == 2
    assert f"exported the model to {tmp_path}/crash_notice/model/ after {TOTAL} steps" in out
    left = float(re.search(r"preemption notice: ([0-9.]+)s were left", out).group(1))  # the notice file
    assert 0 < left <= 6  # the lab's notice is 6 s
    assert s.steps_completed == TOTAL and s.metrics["accuracy"] > 0.8  # its own hypertune report
