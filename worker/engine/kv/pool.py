"""The device KV pool: one tensor for every layer's paged K/V, and its per-layer views.

Three layouts, chosen from the model's shape (``ModelShape``):

* **K and V of one width** (every family but MLA): ``[layers, 2, blocks, block, Hkv, D]``,
  K at ``[:, 0]`` and V at ``[:, 1]``.
* **K and V of different widths** (MLA with its K/V expanded per head: keys of
  ``qk_nope + qk_rope``, values of ``v_head_dim``): ``[layers, 1, blocks, block, Hkv,
  Dk + Dv]``, each row holding a token's key then its value; K and V are column views of
  it, so they share strides (what the kernels take) and no byte is padding.
* **V inside K** (MLA's latent cache): ``[layers, 1, blocks, block, 1, Dk]``, each row a
  token's latent vector then its rope key; V is the first ``Dv`` columns of K.

The block dimension is always the third, so the host tier copies whole blocks of every
layer the same way in all three (``kv/host_tier.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, Hkv, Dk|Dv]


@dataclass(frozen=True)
class PoolLayout:
    """The widths one token's K/V take in every layer."""

    num_layers: int
    num_kv_heads: int
    k_dim: int
    v_dim: int
    v_in_k: bool = False  # V is the first v_dim columns of K (stored once)

    @property
    def row_width(self) -> int:
        """Values one token takes per layer and KV head in the pool's last dimension."""
        return self.k_dim if self.v_in_k else self.k_dim + self.v_dim

    def bytes_per_token(self, elem: int) -> int:
        """KV bytes one token takes over every layer, ``elem`` bytes a value."""
        return self.num_layers * self.num_kv_heads * self.row_width * elem

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, list[KVCache]]:
        """(pool, [(k, v)] per layer), zeroed; ``num_blocks`` includes any scratch block."""
        same = not self.v_in_k and self.k_dim == self.v_dim
        two, width = (2, self.k_dim) if same else (1, self.row_width)
        pool = torch.zeros((self.num_layers, two, num_blocks, block_size, self.num_kv_heads,
                            width), dtype=dtype, device=device)
        if same:
            return pool, [(pool[i, 0], pool[i, 1]) for i in range(self.num_layers)]
        k_end = self.k_dim
        v_start = 0 if self.v_in_k else self.k_dim
        return pool, [(pool[i, 0, ..., :k_end], pool[i, 0, ..., v_start:v_start + self.v_dim])
                      for i in range(self.num_layers)]
