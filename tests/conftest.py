"""Test-suite defaults.

Strict mode of the thread backend is the default for every thread rank in the suite (SHARDWISE_STRICT=1): point to
point is unbuffered and untagged, each rank's operations on a communicator run in order on one stream, collectives
must come in one order on every rank and tensors must live on comm.device, NCCL's rules (comm/strict_stream.py),
so the CPU suite catches what would only fail or hang on GPUs. It is not a second matrix: the same tests run once,
strict. Run with SHARDWISE_STRICT=0 to compare with the buffered backend; a test that needs buffered semantics
passes strict=False to ThreadWorld and says why.

One intra-op thread per process (OMP_NUM_THREADS=1, inherited by every process a test starts, unless set already):
`make test` runs two pytest workers on a 2-core machine, and each worker's ranks are threads or processes of their
own, so torch's default of one OpenMP thread per core oversubscribed the cores several times over, its threads
spinning between parallel regions while the other worker's waited. Measured on six thread-rank files (176 tests,
-n 2): 105 s with torch's default, 85.5 s with one thread.
"""

import itertools
import os

import pytest

os.environ.setdefault("SHARDWISE_STRICT", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by torch when it is first imported, after this file


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: order what runs
def pytest_collection_modifyitems(config, items):
    """Whole files, alternating between those with a test that starts processes (marked `multiprocess`) and the rest,
    each kind in xdist's own order (most tests first); each file keeps its own order.

    `make test` hands whole files to its two workers in collection order (--dist loadfile --no-loadscope-reorder),
    a worker taking the next file when it is free. The process tests are the long poles (20-60 s each on a busy
    2-core machine, against 0.1-5 s for a thread-rank test) and spend much of that starting interpreters and
    waiting on timeouts. xdist's order (most tests first) left them to the end, where one long file on one worker
    leaves the other idle and the two workers' process tests, running together, crowd each other towards their
    timeouts. Alternating starts them early (list scheduling ends best with the long jobs started first: Graham
    1969) with, most of the time, a thread-rank file on the other worker; the many short thread-rank files fill in
    the end."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    process, threads = [], []
    for tests in sorted(files.values(), key=len, reverse=True):  # stable: collection order among equals
        (process if any(t.get_closest_marker("multiprocess") for t in tests) else threads).append(tests)
    ordered = [tests for pair in itertools.zip_longest(process, threads) for tests in pair if tests is not None]
    items[:] = [item for tests in ordered for item in tests]


@pytest.fixture
def one_rank_world():
    """A one-rank gloo default group in this process (tests of the torch.distributed communicator), destroyed
    afterwards whatever happens."""
    import datetime

    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group is already initialised in the test process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10))
    try:
        yield
    finally:
        dist.destroy_process_group()
