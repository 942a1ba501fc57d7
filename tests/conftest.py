"""Test-suite defaults.

Strict mode of the thread backend is the default for every thread rank in the suite (SHARDWISE_STRICT=1): point to
point is unbuffered and untagged, each rank's operations on a communicator run in order on one stream, collectives
must come in one order on every rank and tensors must live on comm.device, NCCL's rules (comm/strict_stream.py),
so the CPU suite catches what would only fail or hang on GPUs. It is not a second matrix: the same tests run once,
strict. Run with SHARDWISE_STRICT=0 to compare with the buffered backend; a test that needs buffered semantics
passes strict=False to ThreadWorld and says why.
"""

import os

os.environ.setdefault("SHARDWISE_STRICT", "1")
