"""One rank of the two-host test (tests/test_two_hosts.py), started inside a network namespace by torchrun or by
`shardwise run` (both set GROUP_RANK and LOCAL_WORLD_SIZE, which the cut variant reads):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank K --master-addr 198.18.0.1 --master-port P \
        tests/two_hosts_worker.py {parity|cut} OUT_DIR TIMEOUT

The rank joins the job with `sw.init(backend="gloo", timeout=TIMEOUT)`: the launcher on node 0 hosts the store on
198.18.0.1, gloo talks over the veth that GLOO_SOCKET_IFNAME names (the test sets it), and every key of the job
lives under SHARDWISE_JOB_TOKEN. What it writes to OUT_DIR is all the test reads (files, written atomically):

* parity: the demo GPT (tiny preset) trained STEPS steps with ZeRO-3 over the four ranks, then with dp2 x tp2
  (`sw.parallelize`, Megatron plan, ZeRO-3 over dp), in the same job. `rank<r>.pt` holds, per case, the loss of
  every step (averaged over the world: each data-parallel rank computes the loss of its slice of the global batch)
  and the full state dict. The test compares them with one process trained on the whole global batch.
* cut: ZeRO-3 steps until something fails. After every step `progress<r>` holds the number of steps done, so the
  test knows when to cut the link. A CommError is recorded in `error<r>.json` (operation, peers, seconds waited,
  message, wall-clock time); the rank then waits (boundedly) until the other ranks of its node have recorded theirs
  and raises it again, as a training script would: torchrun's agent terminates a node's other workers as soon as
  one fails, and a rank that returned early would be read by its peers' failure detector as "already returned"
  instead of as a fellow victim. Any other exception is recorded in `failed<r>.txt`.

`pid<r>` holds the rank's process id; SIGUSR1 makes it print every thread's stack (faulthandler), which the test
asks for before it kills a run that did not end in time.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from compose_cases import optimizer
from parity import CONFIG, batch

import shardwise as sw
from shardwise.models import GPT

STEPS = 3
MAX_NORM = 0.3
CUT_MAX_STEPS = 10_000  # the cut variant trains until the link goes down; this only bounds a run nobody cuts


def _write(path: Path, data: bytes) -> None:
    """Write atomically (temp file + rename): the test polls these files while the rank writes them."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _world_mean(comm, loss: torch.Tensor) -> float:
    value = loss.detach().reshape(1).clone()
    comm.all_reduce(value, sw.ReduceOp.AVG)
    return float(value.item())


def _train_zero3(comm, steps: int, on_step=None) -> dict:
    model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3)
    opt = optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(step % 64, comm.rank, comm.size)
        loss = model(x, y)
        loss.backward()
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(_world_mean(comm, loss))
        if on_step is not None:
            on_step(step + 1)
    return {"losses": losses, "state": sw.full_state_dict(model)}


def _train_dp2_tp2(comm) -> dict:
    mesh = sw.Mesh(comm, dp=2, tp=2, pp=1)
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt", dp_strategy="zero3")
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step, mesh.coords.dp, 2)
        loss = model.step(x, y)
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(_world_mean(comm, loss))
    return {"losses": losses, "state": sw.full_state_dict(model)}


def parity(comm, out: Path) -> None:
    result = {"zero3": _train_zero3(comm, STEPS), "dp2xtp2": _train_dp2_tp2(comm)}
    tmp = out / f"rank{comm.rank}.pt.tmp"
    torch.save(result, tmp)
    os.replace(tmp, out / f"rank{comm.rank}.pt")


def cut(comm, out: Path) -> None:
    progress = out / f"progress{comm.rank}"
    try:
        _train_zero3(comm, CUT_MAX_STEPS, on_step=lambda n: _write(progress, str(n).encode()))
    except sw.CommError as exc:
        record = {"op": exc.op, "rank": exc.rank, "peers": list(exc.peers), "waited": exc.waited,
                  "message": str(exc), "t": time.time()}
        _write(out / f"error{comm.rank}.json", json.dumps(record).encode())
        node, per_node = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        local = [out / f"error{r}.json" for r in range(node * per_node, (node + 1) * per_node)]
        deadline = time.monotonic() + 4 * comm.timeout
        while not all(p.exists() for p in local) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise
    raise RuntimeError(f"the link was never cut: {CUT_MAX_STEPS} steps trained")


def main() -> None:
    mode, out, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    rank = int(os.environ.get("RANK", "-1"))
    _write(out / f"pid{rank}", str(os.getpid()).encode())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        comm = sw.init(backend="gloo", timeout=timeout)
        if mode == "parity":
            parity(comm, out)
        elif mode == "cut":
            cut(comm, out)
        else:
            raise ValueError(f"two_hosts_worker: mode={mode!r}; allowed 'parity' or 'cut'")
    except Exception as exc:
        if not (mode == "cut" and isinstance(exc, sw.CommError)):  # the cut's CommError is in error<r>.json
            _write(out / f"failed{rank}.txt", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}".encode())
        raise


if __name__ == "__main__":
    main()
