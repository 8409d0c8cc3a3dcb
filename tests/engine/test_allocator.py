"""``tune_allocator`` keeps freed step-sized tensors in the process: the next step faults no new pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A prefill-sized MLP (4096 tokens) run 10 times in a thread, as the engine runs steps;
# prints the minor page faults of those 10 runs.
_PROBE = """
import resource, sys, threading
import torch
import torch.nn.functional as F
if sys.argv[1] == "1":
    from rill.engine.allocator import tune_allocator
    print(tune_allocator(), file=sys.stderr)
torch.set_num_threads(1)
faults = []
def steps():
    x = torch.ones(4096, 576, dtype=torch.bfloat16)
    w = torch.ones(3072, 576, dtype=torch.bfloat16)
    def once():
        normed = F.rms_norm(x, (576,))
        gate_up = F.linear(normed, w)
        gate, up = gate_up.chunk(2, -1)
        out = F.silu(gate) * up
        return out.sum()
    once()
    once()  # the heap grows to the step's working set
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        once()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(faults[0])
"""


def _faults(tuned: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, "1" if tuned else "0"], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


def _bf16_is_native() -> bool:
    from rill.models.loader import default_dtype

    return default_dtype() == "bfloat16"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.skipif(
    not _bf16_is_native(),
    reason="bf16 is emulated on this CPU, and its GEMM (like float32's, which rill serves here) "
    "maps scratch memory of its own on every call, which no malloc setting keeps",
)
def test_freed_step_tensors_are_reused_without_page_faults() -> None:
    untuned, tuned = _faults(False), _faults(True)
    # One step's gate/up output alone is 6,144 pages of 4 KiB.
    assert untuned > 6_144, f"glibc's defaults should fault the step's tensors anew ({untuned} faults)"
    assert tuned < untuned // 20
