"""An asynchronous save that the script never waits for is finished when the process exits, not lost.

Before, a script whose last line was `sw.save_checkpoint(..., async_save=True)` exited while the daemon writer
thread ran: the checkpoint stayed a hidden `.tmp-step-*` directory and `latest` was never written.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise as sw

_SRC = str(Path(__file__).resolve().parents[1] / "src")

# Big enough (about 40 MB of float32) that writing and fsyncing it outlasts the interpreter's exit.
_SCRIPT = """
import sys, torch, shardwise as sw
from safetensors.torch import save_file
comm = sw.init(timeout=60)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(10)])
wrapped = sw.DDP(model, comm) if sys.argv[2] == "ddp" else sw.ZeRO(model, comm, stage=3)
full = sw.full_state_dict(wrapped)
if comm.rank == 0:
    save_file({k: v.contiguous() for k, v in full.items()}, sys.argv[1] + "/reference.safetensors")
sw.save_checkpoint(sys.argv[1] + "/ckpt", wrapped, step=3, async_save=True)  # the handle is dropped
"""


def _plain() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(10)])


def _assert_complete(out: Path) -> None:
    from safetensors.torch import load_file

    ckpt = out / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000003"], sorted(ckpt.iterdir())
    model = _plain()
    sw.load_checkpoint(ckpt, model, comm=sw.init())
    reference = load_file(str(out / "reference.safetensors"))
    state = model.state_dict()
    assert sorted(state) == sorted(reference)
    for name, value in reference.items():
        assert torch.equal(state[name], value), name


def test_a_never_waited_async_save_of_one_process_is_complete_after_exit(tmp_path):
    script = tmp_path / "save_and_exit.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "ddp"], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": _SRC, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "waiting for the asynchronous save" in done.stderr
    _assert_complete(tmp_path)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_never_waited_async_saves_of_two_zero3_ranks_are_one_complete_checkpoint_after_exit(tmp_path):
    from shardwise.launch.supervise import RunConfig, run

    script = tmp_path / "save_and_exit.py"
    script.write_text(_SCRIPT)
    result = run(RunConfig(str(script), (str(tmp_path), "zero3"), nproc=2, timeout=60))
    assert not result.failures, result.report()
    _assert_complete(tmp_path)
