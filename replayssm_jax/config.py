"""Static configuration of one ReplaySSM linear-attention layer."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from replayssm_jax.gates import GATES, GateKind, gate_kind
from replayssm_jax.validation import check_positive_int

_STATE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _float_dtype(name: str, value: object) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError as err:
        raise ValueError(f"{name} must be a floating dtype, got {value!r}") from err
    if dtype not in _STATE_DTYPES:
        names = ", ".join(d.name for d in _STATE_DTYPES)
        raise ValueError(f"{name} must be one of {names}, got {dtype.name}")
    return dtype


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """Shapes and dtypes of one ReplaySSM layer.

    Attributes:
      num_k_heads: H_k, key/query heads.
      num_v_heads: H_v, value heads; a multiple of H_k (value head h uses key head
        h // (H_v // H_k)).
      head_k_dim: d_k.
      head_v_dim: d_v.
      cache_len: L, the replay window. A slot flushes its state into the checkpoint on
        the step where it already holds L - 1 cached entries; L = 1 flushes every step
        (the plain recurrence).
      gate: the name of a registered gate kind (`replayssm_jax.gates.GATES`): "gdn" (one
        log-decay per value head), "kda" (one per key channel) or "mamba2" (the additive
        rule; heads, head dim, state size and groups on the fields above, see
        `ReplayConfig.mamba2`).
      state_dtype: dtype of the checkpoint.
      cache_dtype: dtype of the u and k caches (the g cache is always float32).
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    cache_len: int
    gate: str = "gdn"
    state_dtype: np.dtype = np.dtype(jnp.float32)
    cache_dtype: np.dtype = np.dtype(jnp.float32)

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "cache_len"):
            object.__setattr__(self, name, check_positive_int(name, getattr(self, name)))
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads "
                f"({self.num_k_heads})"
            )
        gate_kind(self.gate)
        object.__setattr__(self, "state_dtype", _float_dtype("state_dtype", self.state_dtype))
        object.__setattr__(self, "cache_dtype", _float_dtype("cache_dtype", self.cache_dtype))

    @classmethod
    def mamba2(cls, num_heads: int, head_dim: int, state_size: int, num_groups: int, cache_len: int,
               **dtypes) -> ReplayConfig:
        """A Mamba-2 layer: H heads of dim P, state size N, G groups of B/C (head h uses group
        h // (H/G)), on the GDN layout (H_v = H, d_v = P, d_k = N, H_k = G)."""
        return cls(num_k_heads=num_groups, num_v_heads=num_heads, head_k_dim=state_size,
                   head_v_dim=head_dim, cache_len=cache_len, gate="mamba2", **dtypes)

    @property
    def group_size(self) -> int:
        """Value heads per key head (the GQA ratio r)."""
        return self.num_v_heads // self.num_k_heads

    @property
    def gate_kind(self) -> GateKind:
        return GATES[self.gate]

    @property
    def per_channel_gate(self) -> bool:
        return self.gate_kind.per_channel

    def g_shape(self, batch: int) -> tuple[int, ...]:
        """Shape of one step's log-decay input for `batch` rows."""
        return self.gate_kind.token_shapes(self, batch)["g"]

    def state_bytes_per_slot(self) -> int:
        """Checkpoint bytes of one slot (all value heads)."""
        return self.num_v_heads * self.head_v_dim * self.head_k_dim * self.state_dtype.itemsize
