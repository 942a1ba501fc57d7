"""Megatron-style tensor-parallel layers (the overview; the code is in layer_base.py, linear.py, embedding.py).

Shoeybi et al. (2019), "Megatron-LM", section 3; Megatron-core ``tensor_parallel/layers.py``. For ``Y = X A^T + b``
with ``A`` of shape (out, in):

* :class:`ColumnParallelLinear` splits ``A`` by output features: rank r holds rows ``r*out/tp:(r+1)*out/tp`` and
  the matching bias slice, reads the whole input (entered through ``f`` = copy_to_region, whose backward all-reduces
  the input's gradient) and produces its slice of the output features. With ``gather_output=True`` the slices are
  all-gathered along the last dim into the full output.
* :class:`RowParallelLinear` splits ``A`` by input features: rank r holds columns ``r*in/tp:(r+1)*in/tp``, reads its
  slice of the input's features (as produced by a column-parallel layer, ``input_is_parallel=True``) and produces a
  partial sum of the whole output, completed by ``g`` = reduce_from_region (an all-reduce). The bias is replicated
  and added once, after the reduction.
* :class:`VocabParallelEmbedding` splits the table by vocabulary rows: rank r holds ids ``[r*V/tp, (r+1)*V/tp)``,
  looks up the ids it owns, writes zeros for the others, and the all-reduce of ``g`` assembles every row.

Sequence parallel (``sequence_parallel=True``, Korthikanti et al. 2022): the activations outside the layers are
sharded along ``sequence_dim`` (default 1, batch-first ``(B, T, ...)``). A column-parallel layer then all-gathers its
input along the sequence (``f-bar``; reduce-scatter of the gradient in backward), and a row-parallel layer or the
embedding reduce-scatters its output (``g-bar``; all-gather in backward). A row-parallel bias is then added on the
sequence shard, so its gradient is all-reduced over the group (see `sequence_parallel.py`). The column-parallel layer
keeps the gathered input for its weight gradient (as PyTorch's DTensor sequence parallel does; Megatron instead keeps
the shard and all-gathers it again in backward, trading one more all-gather per layer for that memory).

Overlap. The two Linear layers run as one autograd Function each (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``) rather than ``f`` / ``g`` around ``F.linear``: the
column-parallel backward starts the all-reduce (or reduce-scatter) of the input gradient asynchronously and computes
the weight gradient while it is in flight, and the row-parallel forward reduces the matmul output in place (it owns
that buffer), saving a copy. The traffic is exactly that of ``f`` and ``g``.

Fused outputs (``fused=k`` on a column-parallel layer): a layer whose output is k equal blocks laid side by side,
such as the GPT's ``qkv`` = ``[q | k | v]``, is split block by block: rank r takes its slice of every block, so its
local output is ``[q_r | k_r | v_r]`` and attention heads stay whole (the caller makes each slice a whole number of
heads). The gathered output and :meth:`full_weight` undo the interleaving, returning the original layout.

Every layer can be built from an existing dense layer (:meth:`from_dense`) by slicing its weights, so a
parallelised model starts exactly equal to the original; built directly, the full weight is drawn as the dense
layer would draw it (from a seeded generator, identical on every rank) and sliced, so the values do not depend on
the tensor-parallel size. :meth:`full_weight` / :meth:`full_state` all-gather the original tensors (collective).
"""
from .embedding import VocabParallelEmbedding
from .layer_base import TensorParallelLayer
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "TensorParallelLayer"]
