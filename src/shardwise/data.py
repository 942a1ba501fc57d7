"""Byte-level training data: a corpus of bytes and a deterministic, rank-sharded batch sampler.

Tokens are raw bytes (vocab 256), so there is no tokenizer to download or version. The default corpus is the
Python standard library's own ``.py`` sources, which every machine running shardwise already has: identical
on machines with the same Python build, and several megabytes of real, structured text.

Sampling is a pure function of ``(seed, step)``: the global batch of a step is ``batch_size * world_size``
random windows whose offsets come from a generator seeded with (seed, step) alone, and data-parallel rank r
takes rows ``[r*batch_size, (r+1)*batch_size)``. Hence N ranks together see exactly the batch one process
would see with ``batch_size * N`` rows, which is what the parity tests compare against, and resuming from a
checkpoint needs nothing but the step number.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sysconfig
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

__all__ = ["ByteCorpus", "ShardedSampler", "TEXT_SUFFIXES"]

#: File suffixes read when ``ByteCorpus`` is given a directory.
TEXT_SUFFIXES = frozenset(
    {".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".hpp", ".cfg", ".ini", ".toml", ".json",
     ".yaml", ".yml", ".csv", ".html", ".js", ".sh", ".tex"}
)
# Not part of the language's sources, or differ between installs of the same Python version.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_SKIP_FILE_PREFIXES = ("_sysconfigdata",)  # generated per build; would break cross-machine determinism


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _walk_sorted(root: Path, suffixes: frozenset[str], skip_dirs: frozenset[str]) -> list[Path]:
    """Files under root with one of ``suffixes``, sorted by relative POSIX path (independent of the OS's order)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for name in filenames:
            if Path(name).suffix in suffixes and not name.startswith(_SKIP_FILE_PREFIXES + (".",)):
                found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _concat(files: Sequence[Path], max_bytes: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    for f in files:
        if total >= max_bytes:
            break
        chunk = f.read_bytes()
        if parts:
            chunk = b"\n" + chunk
        parts.append(chunk[: max_bytes - total])
        total += len(parts[-1])
    return b"".join(parts)


def _step_seed(seed: int, step: int) -> int:
    # A hash rather than seed + step so that (seed, step) and (seed + 1, step - 1) are unrelated streams.
    digest = hashlib.blake2b(struct.pack("<qq", seed, step), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class ByteCorpus:
    """A byte string held as a ``torch.uint8`` tensor, with deterministic batch sampling.

    Args:
        path: ``None`` for the Python standard library's ``.py`` files (``sysconfig.get_paths()["stdlib"]``,
            excluding site-packages, test directories and build-generated files); a file, read as bytes; or a
            directory, whose files with a suffix in :data:`TEXT_SUFFIXES` are read. Directory files are taken
            in sorted relative-path order and joined with ``b"\\n"``.
        max_bytes: the corpus is truncated to this many bytes.

    Attributes:
        tokens: 1-D ``torch.uint8`` tensor of the bytes.
        vocab_size: always 256.
        source: human-readable description of where the bytes came from.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it).
        ValueError: ``max_bytes`` is not a positive int, or the source holds no bytes.
    """

    vocab_size: int = 256

    def __init__(self, path: str | os.PathLike[str] | None = None, max_bytes: int = 8_000_000) -> None:
        _check_int("max_bytes", max_bytes, 1)
        if path is None:
            root = Path(sysconfig.get_paths()["stdlib"])
            files = _walk_sorted(root, frozenset({".py"}), _SKIP_DIRS)
            data = _concat(files, max_bytes)
            self.source = f"Python {sysconfig.get_python_version()} standard library sources at {root}"
        else:
            p = Path(path)
            if not p.exists():
                raise FileNotFoundError(f"ByteCorpus path {str(p)!r} does not exist")
            if p.is_dir():
                files = _walk_sorted(p, TEXT_SUFFIXES, frozenset({"__pycache__"}))
                if not files:
                    raise ValueError(
                        f"ByteCorpus directory {str(p)!r} has no text files (suffixes {sorted(TEXT_SUFFIXES)})"
                    )
                data = _concat(files, max_bytes)
                self.source = f"{len(files)} text files under {p}"
            else:
                with open(p, "rb") as fh:
                    data = fh.read(max_bytes)
                self.source = f"file {p}"
        if not data:
            raise ValueError(f"ByteCorpus source is empty: {self.source}")
        # bytearray: torch.frombuffer wants a writable buffer; the tensor owns this copy.
        self.tokens: torch.Tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.tokens.numel()

    def __repr__(self) -> str:
        return f"ByteCorpus({len(self)} bytes from {self.source})"

    def decode(self, tokens: torch.Tensor | Sequence[int]) -> str:
        """Bytes -> text; invalid UTF-8 (a window may cut a character in half) becomes U+FFFD."""
        values = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return bytes(values).decode("utf-8", errors="replace")

    def batch(
        self,
        step: int,
        batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s share of the global batch of ``step``: ``(x, y)``, int64, each (batch_size, seq_len).

        The global batch is ``batch_size * world_size`` windows of ``seq_len + 1`` bytes at offsets drawn from
        a generator seeded by (seed, step) only; ``x`` is a window without its last byte, ``y`` without its
        first (next-byte targets). This rank returns rows ``[rank*batch_size, (rank+1)*batch_size)``.
        """
        _check_int("step", step, 0)
        _check_int("batch_size", batch_size, 1)
        _check_int("seq_len", seq_len, 1)
        _check_int("world_size", world_size, 1)
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
            raise ValueError(f"seed must be a 64-bit int, got {seed!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        n = len(self)
        if n < seq_len + 1:
            raise ValueError(
                f"corpus has {n} bytes, fewer than seq_len + 1 = {seq_len + 1} needed for one window "
                f"({self.source})"
            )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_step_seed(seed, step))
        # All global offsets are drawn on every rank so that a row's offset never depends on the layout.
        offsets = torch.randint(0, n - seq_len, (batch_size * world_size,), generator=gen)
        mine = offsets[rank * batch_size : (rank + 1) * batch_size]
        windows = self.tokens[mine[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class ShardedSampler:
    """Infinite iterator over one data-parallel rank's batches: yields ``corpus.batch(step, ...)``, step += 1.

    ``step`` is the data position: the next batch yielded is that of ``step``. ``state_dict()`` records it
    (with the seed) so a resumed run continues the same stream; the layout (rank, world_size, batch_size,
    seq_len) belongs to the current run and comes from the constructor, so a checkpoint can resume on a
    different number of ranks and still see the same global batches if ``batch_size * world_size`` is kept.
    """

    def __init__(
        self,
        corpus: ByteCorpus,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        start_step: int = 0,
    ) -> None:
        _check_int("start_step", start_step, 0)
        self.corpus = corpus
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.step = start_step
        # Validate everything now rather than on the first next(): errors belong at construction.
        corpus.batch(start_step, batch_size, seq_len, seed=seed, rank=rank, world_size=world_size)

    @property
    def global_batch_size(self) -> int:
        """Rows per step summed over all ranks: ``batch_size * world_size``."""
        return self.batch_size * self.world_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.corpus.batch(
            self.step, self.batch_size, self.seq_len, seed=self.seed, rank=self.rank, world_size=self.world_size
        )
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """``{"step", "seed", "global_batch_size"}``: plain ints, JSON-serialisable."""
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore ``step`` and ``seed`` (``global_batch_size`` is informational and not enforced)."""
        if "step" not in state:
            raise ValueError(f"sampler state has no 'step' key; got keys {sorted(state)}")
        _check_int("state['step']", state["step"], 0)
        seed = state.get("seed", self.seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"state['seed'] must be an int, got {seed!r}")
        self.step = state["step"]
        self.seed = seed
