"""The process is left as found too: the switches a forward may flip (TF32, cuDNN, threads, determinism, SDPA
backends, grad mode, default dtype and device), the global module hooks it may register, and the interval timer
that the code around a run (pytest-timeout's signal method) may be counting on."""

from __future__ import annotations

import signal
import time

import pytest
import torch
import torch.nn as nn

from fwdcheck.config.registry import select
from fwdcheck.config.schema import Inputs, RunConfig
from fwdcheck.model.tested import ModelUnderTest
from fwdcheck.run.limits import CheckTimeout, time_limit
from fwdcheck.run.model_state import GlobalState
from fwdcheck.run.runner import run_model
from fwdcheck.run.settings import Settings

backends = torch.backends


def switches() -> dict:
    return {
        "matmul precision": torch.get_float32_matmul_precision(),
        "cuda matmul allow_tf32": backends.cuda.matmul.allow_tf32,
        "cudnn allow_tf32": backends.cudnn.allow_tf32,
        "cudnn benchmark": backends.cudnn.benchmark,
        "cudnn deterministic": backends.cudnn.deterministic,
        "threads": torch.get_num_threads(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "flash sdp": backends.cuda.flash_sdp_enabled(),
        "math sdp": backends.cuda.math_sdp_enabled(),
        "grad": torch.is_grad_enabled(),
        "default dtype": torch.get_default_dtype(),
        "default device": torch.get_default_device(),
        "global forward hooks": list(nn.modules.module._global_forward_hooks),
        "global forward pre-hooks": list(nn.modules.module._global_forward_pre_hooks),
        "function mode": torch._C._is_torch_function_mode_enabled(),
    }


class FlipsSwitches(nn.Module):
    """A forward that sets what model code sets for speed or reproducibility, and registers a global hook."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.threads = torch.get_num_threads() + 1

    def forward(self, input_ids):
        backends.cuda.matmul.allow_tf32 = True
        backends.cudnn.allow_tf32 = False
        backends.cudnn.benchmark = True
        backends.cudnn.deterministic = True
        torch.set_float32_matmul_precision("medium")
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        backends.cuda.enable_flash_sdp(False)
        if not nn.modules.module._global_forward_hooks:
            nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
        return self.head(self.embed(input_ids))


def test_switches_a_forward_flips_are_put_back():
    before = switches()
    model = ModelUnderTest(module=FlipsSwitches(), label="flips", source="python", vocab_size=16)
    report = run_model(model, Settings(RunConfig(inputs=Inputs(seq_len=4))), select(["shape-ledger"]))
    assert report.exit_code == 0, report.results[0].summary
    assert switches() == before
    notes = " ".join(report.notes)
    for name in (
        "torch.backends.cudnn.benchmark",
        "torch.get_num_threads()",
        "torch.get_float32_matmul_precision()",
        "torch.backends.cuda.flash_sdp_enabled()",
        "torch.are_deterministic_algorithms_enabled()",
        "torch.nn.modules.module._global_forward_hooks",
    ):
        assert name in notes, (name, report.notes)


def test_every_switch_is_taken_and_put_back():
    before = switches()
    state = GlobalState.take()
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    torch.set_grad_enabled(False)
    backends.cuda.enable_math_sdp(False)
    backends.cuda.matmul.fp32_precision = "tf32"  # torch's newer API: the legacy flags read it
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        notes = state.restore()
    finally:
        handle.remove()
    assert switches() == before
    assert len(notes) >= 5, notes


# ---------------------------------------------------------------------------------------------------------------------
# The interval timer: one per process, shared with whoever armed it before the run


@pytest.fixture
def enclosing_timer():
    """An enclosing SIGALRM handler that records when it fires, as pytest-timeout's signal method would install."""
    fired: list[float] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(time.monotonic()))
    yield fired
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def test_an_enclosing_timer_fires_on_time_during_the_block(enclosing_timer):
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    with time_limit(5):
        while time.monotonic() - start < 0.6:
            time.sleep(0.01)
    assert len(enclosing_timer) == 1 and 0.15 < enclosing_timer[0] - start < 0.45, enclosing_timer
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_an_enclosing_timer_keeps_its_remaining_time_and_handler(enclosing_timer):
    handler = signal.getsignal(signal.SIGALRM)
    signal.setitimer(signal.ITIMER_REAL, 30)
    start = time.monotonic()
    with pytest.raises(CheckTimeout), time_limit(0.2):
        time.sleep(5)
    remaining, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 29 < remaining <= 30 - (time.monotonic() - start) + 0.01, remaining
    assert signal.getsignal(signal.SIGALRM) is handler
    assert not enclosing_timer


def test_an_enclosing_time_limit_ends_a_hung_inner_block_on_its_own_deadline():
    start = time.monotonic()
    with pytest.raises(CheckTimeout) as raised, time_limit(0.3), time_limit(60):
        time.sleep(5)
    assert raised.value.seconds == 0.3 and time.monotonic() - start < 2
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
