"""Docs that cannot rot: every ```python block of README.md and docs/*.md runs here, so a renamed argument fails.

How a block runs (docs/guide.md, "Docs that run", says the same to writers):
* in this process, in a fresh namespace that already holds a tiny world to act on (`PRELUDE`): `torch`, `nn`, `sw`,
  `tp`, `pp`, `comm` (a world of one, as `sw.init()` gives without a launcher), `model` (a tiny GPT), `opt`, a batch
  `x, y` and `batches`, its `loss` (before backward), a tensor `t`, `sampler`; a block that imports or defines these names uses its own;
* small: `GPTConfig()` and `GPTConfig.preset(...)` build a tiny GPT (2 layers, width 32, 128 positions), and a loop
  over `range(...)` runs its first 2 iterations only; thread ranks of `sw.launch` stay threads.
* A block that cannot run so (it needs processes, MPI, a GPU, a model download, or is a listing of signatures with
  placeholder names) carries a marker on the line before its fence, `<!-- docs-test: skip <reason> -->` (or
  `processes`, `mpi`, `gpu` instead of `skip`); it is reported as skipped with that reason, never silently.
"""

from __future__ import annotations

import builtins
import os
import re
from pathlib import Path

import pytest
import torch

import shardwise as sw
import shardwise.models as models
from shardwise.data import ByteCorpus, ShardedSampler
from shardwise.models import gpt

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARK = re.compile(r"<!--\s*docs-test:\s*(skip|processes|mpi|gpu)\b\s*:?\s*(.*?)\s*-->")
TINY = dict(vocab_size=256, seq_len=128, d_model=32, n_heads=2, n_layers=2)
MAX_ITERATIONS = 2


def python_blocks(path: Path) -> list[tuple[int, str, tuple[str, str] | None]]:
    """(line of the fence, source, (marker kind, reason) or None) for each ```python block of a markdown file."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            before = next((lines[j] for j in range(start - 2, -1, -1) if lines[j].strip()), "")
            mark = _MARK.search(before)
            blocks.append((start, "\n".join(body) + "\n", (mark.group(1), mark.group(2)) if mark else None))
        i += 1
    return blocks


CASES = [pytest.param(path, line, source, mark, id=f"{path.relative_to(ROOT)}:{line}")
         for path in DOCS for line, source, mark in python_blocks(path)]


_GPTConfig = gpt.GPTConfig  # the real one, whatever a test patched


class _TinyGPTConfig(_GPTConfig):
    """GPTConfig whose defaults and presets are tiny, so that a documented training loop runs in a test."""

    def __init__(self, **fields):  # noqa: ANN003
        super().__init__(**{**TINY, **{k: v for k, v in fields.items() if k not in TINY}})

    @classmethod
    def preset(cls, name: str, **overrides):  # noqa: ANN206
        _GPTConfig.preset(name)  # an unknown preset still raises
        return cls(**overrides)


def _short_range(*args: int) -> range:
    return builtins.range(*args)[:MAX_ITERATIONS]


def _prelude(comm: sw.Communicator) -> dict:
    model = models.GPT(_TinyGPTConfig(), seed=0)
    corpus = ByteCorpus(max_bytes=100_000)
    sampler = ShardedSampler(corpus, 8, TINY["seq_len"])
    x, y = corpus.batch(0, 8, TINY["seq_len"])  # 8 rows: the microbatch counts the docs use divide it
    loss = model(x, y)
    return {"__name__": "__docs__", "torch": torch, "nn": torch.nn, "sw": sw, "tp": sw.tensor_parallel,
            "pp": sw.pipeline, "comm": comm, "model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
            "x": x, "y": y, "loss": loss, "batches": [(x, y)], "t": torch.ones(4), "sampler": sampler, "range": _short_range}


def test_markers_are_well_formed():
    """A `docs-test` comment that the parser does not understand would silently run (or not) a block."""
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "docs-test" in line:
                assert _MARK.search(line), f"{path.relative_to(ROOT)}:{number}: malformed marker {line.strip()!r}"


@pytest.mark.parametrize("path, line, source, mark", CASES)
def test_block_runs(path, line, source, mark, monkeypatch, tmp_path):
    if mark is not None:
        kind, reason = mark
        pytest.skip(f"{path.relative_to(ROOT)}:{line}: {kind}: {reason or 'no reason given'}")
    monkeypatch.setattr(models, "GPTConfig", _TinyGPTConfig)
    monkeypatch.setattr(gpt, "GPTConfig", _TinyGPTConfig)
    monkeypatch.chdir(tmp_path)  # checkpoints, plots and other files a block writes
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    namespace = _prelude(sw.init())
    code = compile(source, f"{path.relative_to(ROOT)}:{line}", "exec")
    exec(code, namespace)  # noqa: S102 - the documentation's own examples


def test_every_doc_has_been_read():
    assert len(CASES) >= 20, [c.id for c in CASES]
    assert os.path.basename(DOCS[0]) == "README.md"
