"""Gradient compression for data-parallel reductions: `sw.DDP(model, comm, compression=sw.compression.PowerSGD(4))`.

Methods (one file each): FP16 / BF16 (cast.py), TopK (topk.py), RandomK (randomk.py), PowerSGD (powersgd.py),
OneBit (onebit.py); OneBitAdam (onebit_adam.py), an optimizer exchanging 1-bit momentum; the interface they share is base.Compressor. See docs/compression.md for when to use which.
A compressor's state follows the step (transaction.py): a skipped step leaves it as it was; state that is not finite
raises NonFiniteStateError.
"""

from .base import Compressor, Payload
from .cast import BF16, FP16
from .onebit import OneBit
from .onebit_adam import OneBitAdam
from .powersgd import PowerSGD
from .randomk import RandomK
from .topk import TopK
from .transaction import NonFiniteStateError

__all__ = ["BF16", "Compressor", "FP16", "NonFiniteStateError", "OneBit", "OneBitAdam", "Payload", "PowerSGD",
           "RandomK", "TopK"]
