"""A small byte-level GPT: the model the demo, the tests and the benchmarks train.

Architecture (GPT-2, pre-norm)::

    idx (B, T) -> tok_emb(idx) + pos_emb(0..T-1) -> drop
               -> blocks[0..L-1]:  x = x + attn(ln1(x));  x = x + mlp(ln2(x))
               -> ln_f -> head -> logits (B, T, V)

The attribute names (``tok_emb``, ``pos_emb``, ``drop``, ``blocks``, ``ln_f``, ``head``; per block ``ln1``,
``attn.qkv``, ``attn.proj``, ``ln2``, ``mlp.fc``, ``mlp.proj``) are a contract: tensor-parallel plans match
them by name and pipeline partitioning uses :meth:`GPT.pipeline_layers`. The model registers no buffers (the
causal mask comes from ``scaled_dot_product_attention(is_causal=True)``), so every piece of state is a
parameter and every sharding strategy only has to handle parameters.

Initialisation follows GPT-2 (Radford et al., 2019): N(0, 0.02) for weights, N(0, 0.02 / sqrt(2 L)) for the
two residual projections of each block, zero biases, unit LayerNorm scales. Given a ``seed`` the draws come
from a private ``torch.Generator`` so that threads building models concurrently stay deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from .moe import MoE

__all__ = [
    "PRESETS",
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "EmbeddingStage",
    "HeadStage",
    "lm_loss",
]

#: Named configurations for :meth:`GPTConfig.preset`. Parameter counts (tied weights, biases on):
#: ``tiny`` ~0.12 M (unit tests), ``small`` ~3.3 M (the default config; demo), ``bench`` ~7.3 M (benchmarks),
#: ``gpt2`` ~124 M: GPT-2 small's shape (Radford et al. 2019: vocabulary 50257, context 1024, 12 x 768, 12 heads),
#: for GPU benchmarks and planning.
#: ``small`` and ``bench`` have head counts divisible by 2 and 4 so tensor-parallel sizes 2 and 4 work.
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "tiny": MappingProxyType(dict(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2)),
        "small": MappingProxyType(dict(vocab_size=256, seq_len=128, d_model=256, n_heads=4, n_layers=4)),
        "bench": MappingProxyType(dict(vocab_size=256, seq_len=128, d_model=384, n_heads=8, n_layers=4)),
        "gpt2": MappingProxyType(dict(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)),
    }
)


def _check_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; GPTConfig(n_layers=True) is a bug, not a one-layer model.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class GPTConfig:
    """Shape and regularisation of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids; 256 for the byte-level corpus of :mod:`shardwise.data`.
        seq_len: maximum sequence length T; also the number of rows of the position embedding.
        d_model: width of the residual stream; must be divisible by ``n_heads``.
        n_heads: attention heads per block; head_dim = d_model // n_heads. Tensor parallelism splits heads,
            so the tensor-parallel size must divide it.
        n_layers: number of transformer blocks.
        d_ff: hidden width of the MLP; ``None`` means ``4 * d_model`` (see :attr:`ff_dim`).
        dropout: probability used for embedding, attention and residual dropout, in [0, 1). 0.0 makes the
            forward pass deterministic, which the parity tests rely on.
        tie_weights: if True the output head reuses the token embedding matrix (one Parameter, two uses).
        bias: if True the Linear layers (except ``head``) and LayerNorms have biases.
        n_experts: 0 (default) for the dense MLP; E > 0 makes each block's feed-forward a mixture of E experts
            (models/moe.py): ``mlp`` is then a ``MoE`` with ``router``, ``w_in``, ``b_in``, ``w_out``, ``b_out``.
        experts_per_token: k, the experts each token is routed to (1 <= k <= n_experts; unused when dense).
        moe_aux_loss_coef: weight of the Switch load-balancing loss added to the returned loss (>= 0).
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True
    n_experts: int = 0
    experts_per_token: int = 2
    moe_aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
            _check_positive_int(name, getattr(self, name))
        if self.d_ff is not None:
            _check_positive_int("d_ff", self.d_ff)
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ValueError(f"GPTConfig.dropout must be a float in [0, 1), got {self.dropout!r}")
        for name in ("tie_weights", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}")
        self._check_experts()

    def _check_experts(self) -> None:
        E, k, coef = self.n_experts, self.experts_per_token, self.moe_aux_loss_coef
        if isinstance(E, bool) or not isinstance(E, int) or E < 0:
            raise ValueError(f"GPTConfig.n_experts must be an int >= 0 (0: dense MLP), got {E!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (E and k > E):
            raise ValueError(f"GPTConfig.experts_per_token must be an int in [1, n_experts={E}], got {k!r}")
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0 or math.isinf(coef):
            raise ValueError(f"GPTConfig.moe_aux_loss_coef must be a finite number >= 0, got {coef!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        """Hidden width of the MLP: ``d_ff`` if given, else ``4 * d_model``."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        """Return the named configuration from :data:`PRESETS`, with ``overrides`` applied on top.

        Raises ValueError naming the allowed presets if ``name`` is unknown.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; allowed: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused ``qkv`` projection.

    ``qkv`` maps d -> 3d and its output is laid out ``[q | k | v]``, each block d = n_heads * head_dim wide and
    head-major inside (head h owns columns ``h*head_dim:(h+1)*head_dim`` of each block). A tensor-parallel
    plan therefore shards ``qkv`` column-wise by taking the same head slice from each of the three blocks
    (view the weight as ``(3, n_heads, head_dim, d)`` and slice dim 1), and ``proj`` row-wise by the same
    heads. The forward pass never trusts ``n_heads``: it derives the number of local heads from the width of
    the ``qkv`` output (= the out-features of the weight actually held), divided by ``3 * head_dim``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads  # global head count, informational; see class docstring
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        B, T, width = qkv.shape
        if width % (3 * self.head_dim) != 0:
            raise ValueError(
                f"qkv output width {width} is not a multiple of 3 * head_dim = {3 * self.head_dim}; "
                "a tensor-parallel split must cut qkv on head boundaries"
            )
        local_heads = width // (3 * self.head_dim)
        q, k, v = (
            t.view(B, T, local_heads, self.head_dim).transpose(1, 2) for t in qkv.split(width // 3, dim=-1)
        )
        y = self.attend(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, local_heads * self.head_dim)
        return self.drop(self.proj(y))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (B, heads, T, head_dim) q, k, v; shardwise.context_parallel overrides it."""
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )


class MLP(nn.Module):
    """Position-wise feed-forward: ``proj(gelu(fc(x)))`` with ``fc`` d -> d_ff and ``proj`` d_ff -> d.

    A tensor-parallel plan shards ``fc`` column-wise and ``proj`` row-wise (Megatron-LM, Shoeybi et al. 2019).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ff_dim, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.ff_dim, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MoE(config) if config.n_experts else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _embed(tok_emb: nn.Embedding, pos_emb: nn.Embedding, drop: nn.Dropout, idx: torch.Tensor) -> torch.Tensor:
    if idx.dim() != 2 or idx.is_floating_point() or idx.is_complex():
        raise ValueError(f"idx must be an integer tensor of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
    T, seq_len = idx.shape[1], pos_emb.num_embeddings
    if T > seq_len:
        raise ValueError(f"sequence length T={T} exceeds config.seq_len={seq_len}")
    pos = torch.arange(T, device=idx.device)
    return drop(tok_emb(idx) + pos_emb(pos))


def _head(ln_f: nn.LayerNorm, head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return head(ln_f(x))


class EmbeddingStage(nn.Module):
    """First pipeline stage: ``drop(tok_emb(idx) + pos_emb(0..T-1))``, idx (B, T) -> hidden (B, T, d).

    Holds the GPT's own ``tok_emb``, ``pos_emb`` and ``drop`` modules (not copies), so its parameters are the
    model's Parameter objects.
    """

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.tok_emb = tok_emb
        self.pos_emb = pos_emb
        self.drop = drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _embed(self.tok_emb, self.pos_emb, self.drop, idx)


class HeadStage(nn.Module):
    """Last pipeline stage: ``head(ln_f(x))``, hidden (B, T, d) -> logits (B, T, V).

    With tied weights ``head.weight`` is the same Parameter as the embedding stage's ``tok_emb.weight``: a
    pipeline that puts the two stages on different ranks must sum that parameter's two gradients.
    """

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f = ln_f
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _head(self.ln_f, self.head, x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T); usable as a pipeline loss_fn."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match logits shape {tuple(logits.shape)} minus vocab"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """Decoder-only transformer over bytes; see the module docstring for the architecture and init.

    ``GPT(config, seed=7)`` builds bit-identical parameters on every call, in any thread, without touching
    torch's global RNG: the submodules are created on the meta device (so their default initialisers draw
    nothing), materialised on the current default device, then filled from a private generator. Draws are
    made on the CPU in float32 and copied, so the values do not depend on the device. With ``seed=None``
    the draws come from torch's global CPU RNG, as for ordinary modules.

    ``forward(idx)`` returns logits (B, T, V); ``forward(idx, targets)`` returns the scalar mean
    cross-entropy. ``pipeline_layers()`` returns the same computation as a list of stages.
    """

    def __init__(self, config: GPTConfig | None = None, seed: int | None = None) -> None:
        config = GPTConfig() if config is None else config
        if not isinstance(config, GPTConfig):
            raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        super().__init__()
        self.config = config
        device = torch.get_default_device()
        # Built on meta so nn.Linear/nn.Embedding's own reset_parameters consume no global random numbers.
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.to_empty(device=device)
        if config.tie_weights:
            # After to_empty: materialising would otherwise give the two modules separate tensors.
            self.head.weight = self.tok_emb.weight
        if device.type != "meta":
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter as GPT-2 does, from a private generator if ``seed`` is given.

        Modules are visited in ``named_modules()`` order and each unique Parameter is drawn once (the tied
        head is skipped), so the sequence of draws, hence the values, is fixed by (config, seed).
        """
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
        std = 0.02
        # GPT-2: each block adds two residual branches, so their output projections shrink by sqrt(2 L)
        # to keep the residual stream's variance independent of depth.
        resid_std = std / math.sqrt(2 * self.config.n_layers)
        residual = {id(b.attn.proj.weight) for b in self.blocks} | {
            id(b.mlp.proj.weight) for b in self.blocks if isinstance(b.mlp, MLP)}
        seen: set[int] = set()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                w = module.weight
                if id(w) not in seen:
                    seen.add(id(w))
                    _normal_(w, resid_std if id(w) in residual else std, gen)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, MoE):  # its router is an nn.Linear, drawn when visited
                module.reset_experts(gen, std, resid_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) for idx (B, T) with T <= seq_len; the mean cross-entropy if targets are given."""
        # Same functions as the pipeline stages use, so the two paths are bit-identical.
        x = _embed(self.tok_emb, self.pos_emb, self.drop, idx)
        for block in self.blocks:
            x = block(x)
        logits = _head(self.ln_f, self.head, x)
        if targets is None:
            return logits
        loss = lm_loss(logits, targets)
        if self.config.n_experts and self.config.moe_aux_loss_coef:  # Switch load balancing (models/moe.py)
            loss = loss + self.config.moe_aux_loss_coef * sum(b.mlp.aux_loss for b in self.blocks)
        return loss

    def num_parameters(self) -> int:
        """Number of scalars in unique parameters (a tied embedding/head matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a sequence of stages: ``[EmbeddingStage, *blocks, HeadStage]``.

        Applying them in order to idx gives exactly ``self(idx)``. The stages hold this model's own modules,
        so they share its Parameter objects; with ``tie_weights`` the first and last stage share the
        embedding weight (``layers[0].tok_emb.weight is layers[-1].head.weight``).
        """
        return [
            EmbeddingStage(self.tok_emb, self.pos_emb, self.drop),
            *self.blocks,
            HeadStage(self.ln_f, self.head),
        ]


def _normal_(weight: torch.Tensor, std: float, gen: torch.Generator | None) -> None:
    # Drawn on the CPU in fp32 regardless of the weight's device/dtype: same values on every device.
    weight.copy_(torch.empty(weight.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen))
