"""On a GPU (skipped without one): the usage sampler reads the GPU through NVML, and the step
clock's hooks time a CUDA model's backward pass and optimizer step. CI has no GPU; the
device machine runs this file alone (it needs torch, psutil and nvidia-ml-py, not Ray)."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")


def test_the_sampler_reads_this_workers_gpu():
    from launcher.worker.usage import Sampler

    sampler = Sampler(every_s=0)
    assert sampler.sample()[3:] == [0.0, 0.0] or torch.cuda.is_initialized()  # before CUDA: nothing to read
    block = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB held by this process
    a = torch.randn(8192, 8192, device="cuda")
    deadline = time.time() + 3
    busy = []
    while time.time() < deadline:
        for _ in range(20):
            a = a @ a / 8192
        busy.append(sampler.sample())
    torch.cuda.synchronize()
    print("samples (time, cpu %, rss MB, gpu %, gpu MB):", busy[-3:])
    assert sampler._gpu is not None
    assert max(s[4] for s in busy) >= 1000, busy          # this process's GiB (or the device's use)
    assert max(s[3] for s in busy) > 0 and all(0 <= s[3] <= 100 for s in busy), busy
    del block


def test_the_clock_times_a_cuda_step():
    from launcher.worker.timing import StepClock

    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    clock = StepClock()
    clock.watch_gradients(model)
    clock.watch_optimizer(optimizer)
    for _ in range(5):
        model(torch.randn(512, 1024, device="cuda")).pow(2).mean().backward()
        time.sleep(0.02)  # stands for waiting on the other ranks
        optimizer.step()
        optimizer.zero_grad()
        clock.step_done()
    torch.cuda.synchronize()
    print("clock:", clock.seconds)
    assert 0.1 <= clock.seconds["sync"] < 1.0 and clock.seconds["optimizer"] > 0, clock.seconds
