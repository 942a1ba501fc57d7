"""Tests for shardwise.data: the byte corpus and the deterministic, rank-sharded sampler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.data import ByteCorpus, ShardedSampler


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus(max_bytes=2_000_000)


def test_default_corpus_loads(corpus):
    assert len(corpus) == 2_000_000  # the stdlib holds more than that, so it is truncated exactly
    assert corpus.tokens.dtype == torch.uint8 and corpus.tokens.dim() == 1
    assert corpus.vocab_size == 256
    assert "standard library" in corpus.source
    # Real text: many distinct bytes, mostly printable ASCII.
    assert torch.unique(corpus.tokens).numel() > 80
    assert "def " in corpus.decode(corpus.tokens[:200_000])


def test_default_corpus_is_large_and_deterministic():
    full = ByteCorpus()
    assert len(full) > 1_000_000
    small = ByteCorpus(max_bytes=1000)
    assert len(small) == 1000
    assert torch.equal(small.tokens, full.tokens[:1000])


def test_batch_shapes_and_shift(corpus):
    x, y = corpus.batch(0, batch_size=4, seq_len=16)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < 256
    # Each row is a contiguous window of the corpus.
    text = bytes(corpus.tokens.tolist())
    row = bytes(x[0].tolist()) + bytes(y[0, -1:].tolist())
    assert row in text


def test_batch_is_deterministic(corpus):
    a = corpus.batch(3, 4, 16, seed=1)
    b = corpus.batch(3, 4, 16, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], corpus.batch(4, 4, 16, seed=1)[0])
    assert not torch.equal(a[0], corpus.batch(3, 4, 16, seed=2)[0])


@settings(max_examples=15, deadline=None)
@given(
    world_size=st.integers(1, 4),
    batch_size=st.integers(1, 3),
    step=st.integers(0, 10_000),
    seed=st.integers(0, 2**31),
)
def test_rank_shards_concatenate_to_the_global_batch(corpus, world_size, batch_size, step, seed):
    shards = [
        corpus.batch(step, batch_size, 8, seed=seed, rank=r, world_size=world_size) for r in range(world_size)
    ]
    gx, gy = corpus.batch(step, batch_size * world_size, 8, seed=seed)
    assert torch.equal(torch.cat([s[0] for s in shards]), gx)
    assert torch.equal(torch.cat([s[1] for s in shards]), gy)


def test_file_and_directory_sources(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world, " * 10)
    c = ByteCorpus(f)
    assert len(c) == 130 and str(f) in c.source
    assert c.decode(c.tokens[:5]) == "hello"
    assert len(ByteCorpus(str(f), max_bytes=7)) == 7

    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "b.md").write_bytes(b"BBB")
    (d / "sub" / "c.py").write_bytes(b"CCC")
    (d / "a.txt").write_bytes(b"AAA")
    (d / "skip.bin").write_bytes(b"\x00\x01")
    cd = ByteCorpus(d)
    assert cd.decode(cd.tokens) == "AAA\nBBB\nCCC"
    x, y = cd.batch(0, 2, 4)
    assert x.shape == (2, 4)


def test_errors(tmp_path, corpus):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        ByteCorpus(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        ByteCorpus(tmp_path / "empty")
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="e.txt"):
        ByteCorpus(tmp_path / "e.txt")
    (tmp_path / "short.txt").write_bytes(b"abc")
    short = ByteCorpus(tmp_path / "short.txt")
    with pytest.raises(ValueError, match=r"3 bytes.*seq_len \+ 1 = 4.*short.txt"):
        short.batch(0, 1, 3)
    assert short.batch(0, 1, 2)[0].shape == (1, 2)
    with pytest.raises(ValueError, match="max_bytes"):
        ByteCorpus(max_bytes=0)
    with pytest.raises(ValueError, match=r"rank.*world_size=2.*2"):
        corpus.batch(0, 1, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        corpus.batch(0, 1, 8, rank=-1, world_size=2)
    for kwargs, name in [
        (dict(step=-1), "step"),
        (dict(batch_size=0), "batch_size"),
        (dict(seq_len=0), "seq_len"),
        (dict(world_size=0), "world_size"),
    ]:
        args = dict(step=0, batch_size=1, seq_len=8) | kwargs
        with pytest.raises(ValueError, match=name):
            corpus.batch(**args)


def test_sharded_sampler_iterates_and_resumes(corpus):
    s = ShardedSampler(corpus, batch_size=2, seq_len=8, rank=1, world_size=2, seed=7)
    assert s.step == 0 and s.global_batch_size == 4
    first = [next(s) for _ in range(3)]
    assert s.step == 3
    for i, (x, y) in enumerate(first):
        ex, ey = corpus.batch(i, 2, 8, seed=7, rank=1, world_size=2)
        assert torch.equal(x, ex) and torch.equal(y, ey)
    state = s.state_dict()
    assert state == {"step": 3, "seed": 7, "global_batch_size": 4}
    nxt = next(s)

    resumed = ShardedSampler(corpus, batch_size=2, seq_len=8, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert resumed.step == 3 and resumed.seed == 7
    assert torch.equal(next(iter(resumed))[0], nxt[0])

    started = ShardedSampler(corpus, 2, 8, rank=1, world_size=2, seed=7, start_step=3)
    assert torch.equal(next(started)[0], nxt[0])

    with pytest.raises(ValueError, match="rank"):
        ShardedSampler(corpus, 2, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="step"):
        resumed.load_state_dict({"seed": 1})
    with pytest.raises(ValueError, match="start_step"):
        ShardedSampler(corpus, 2, 8, start_step=-1)
