"""Flax NNX modules whose ReplaySSM state lives in NNX variables (needs the `flax` extra).

`GDNDecodeLayer` is the package's Qwen3-Next-style GDN layer (`model.layer`) with its replay
state (`ReplayState`) and causal-conv state held in `ReplayCache` variables, so a model
built of them carries its decode state the NNX way and `nnx.jit(..., donate_argnums=...)`
updates it in place; `Mamba2DecodeLayer` the same for the Mamba-2 layer
(`model.mamba2_layer`). `Decoder` stacks them into the package's small decoder, GDN or
hybrid (same weights and numerics as `model.decoder`): `prefill` continues slots by a
prompt chunk (chunked recurrence, leaves a flushed checkpoint), `decode_step` runs one token
per row with one flush plan for every layer, `verify_window` / `accept_window` score a
speculative window and keep its accepted prefix.

The cache variables are not parameters: filter them out of optimizers and gradients with
`nnx.Param` (e.g. `nnx.state(model, nnx.Param)`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from replayssm_jax.backends import xla
from replayssm_jax.config import ReplayConfig
from replayssm_jax.decode import check_backend
from replayssm_jax.model import decoder as decoder_lib
from replayssm_jax import speculative
from replayssm_jax.model.layer import GDNDims, GDNParams, gdn_plain, gdn_replay, gdn_verify, rms_norm
from replayssm_jax.model.mamba2_layer import (
    Mamba2Dims,
    Mamba2LayerParams,
    mamba2_plain,
    mamba2_replay,
    mamba2_verify,
    ssm_params,
)
from replayssm_jax.plan import FlushPolicy, StepPlan, advance_write_pos, as_policy, plan_step
from replayssm_jax.state import init_state
from replayssm_jax.validation import check_slots


class ReplayCache(nnx.Variable):
    """Decode state of a layer (replay state, conv state): carried, not trained."""


class _DecodeLayer(nnx.Module):
    """What a layer kind's NNX module shares: weights in one `nnx.Param`, the replay state
    and conv state `[N, K - 1, C]` in `ReplayCache`s, `decode` and `prefill` through the
    kind's model-package functions (`_replay`, `_plain`, `_live`)."""

    def __init__(self, params, dims, config: ReplayConfig, num_slots: int, backend: str):
        check_backend(backend)
        self.weights = nnx.Param(params)
        self.replay = ReplayCache(init_state(config, num_slots))
        self.conv = ReplayCache(jnp.zeros((num_slots, dims.conv_kernel - 1, dims.conv_channels), jnp.float32))
        self.dims, self.backend = dims, backend

    def decode(self, x: Float[Array, "B D"], plan: StepPlan) -> Float[Array, "B D"]:
        """One token per row under `plan` (from `plan_step` on this layer's cursors); the
        layer's cursors advance with the plan."""
        out, state, conv = self._replay(self.weights.get_value(), self.dims, x, self.replay.get_value(),
                                        self.conv.get_value(), plan, backend=self.backend)
        self.replay.set_value(dataclasses.replace(state, write_pos=advance_write_pos(state.write_pos, plan)))
        self.conv.set_value(conv)
        return out

    def prefill(self, x: Float[Array, "B T D"], lengths: Int[Array, " B"], slots: Int[Array, " B"]
                ) -> Float[Array, "B T D"]:
        """Continue each row's slot by `lengths[b]` tokens from its live state; the slot then
        holds the result as a flushed checkpoint (cursor 0). Negative slots write nothing."""
        state, conv_pool, weights = self.replay.get_value(), self.conv.get_value(), self.weights.get_value()
        plan = plan_step(state.write_pos, slots, None, state.config.cache_len)
        out, ssm, conv = self._plain(weights, self.dims, x, self._live(weights, state, plan), conv_pool[plan.slot],
                                     lengths)
        target = jnp.where(plan.valid, plan.slot, state.num_slots)
        self.replay.set_value(dataclasses.replace(
            state, checkpoint=state.checkpoint.at[target].set(ssm.astype(state.checkpoint.dtype), mode="drop"),
            write_pos=state.write_pos.at[target].set(0, mode="drop")))
        self.conv.set_value(conv_pool.at[target].set(conv, mode="drop"))
        return out

    def verify(self, x: Float[Array, "B T D"], slots: Int[Array, " B"], parents: Int[Array, "B T"] | None = None
               ) -> tuple[Float[Array, "B T D"], Float[Array, "B T C"]]:
        """A draft window of T tokens per row (`speculative.verify_step`; a tree by `parents`):
        the window's records appended, a row whose ring cannot hold them folded first;
        cursors and conv state untouched until `accept`. Returns `(out, the window's conv
        inputs)`."""
        out, state, conv_inputs = self._verify(self.weights.get_value(), self.dims, x, self.replay.get_value(),
                                               self.conv.get_value(), slots, backend=self.backend, parents=parents)
        self.replay.set_value(state)
        return out, conv_inputs

    def accept(self, slots: Int[Array, " B"], num_accepted: Int[Array, " B"], conv_inputs: Float[Array, "B T C"],
               path: Int[Array, "B P"] | None = None):
        """Keep the first `num_accepted[b]` window tokens of each row (a tree's: along `path`):
        cursor, records and conv state."""
        self.replay.set_value(speculative.accept(self.replay.get_value(), slots, num_accepted, path=path))
        self.conv.set_value(decoder_lib.accept_conv_pool(self.conv.get_value(), slots, num_accepted, conv_inputs,
                                                         path))


class GDNDecodeLayer(_DecodeLayer):
    """One GDN layer over `num_slots` slots with its decode state in NNX variables.

    Args:
      params: the layer's weights (`model.layer.GDNParams`), held as one `nnx.Param`.
      dims: its sizes (`model.layer.GDNDims`).
      config: the `ReplayConfig` of its replay state (heads and head dims match `dims`).
      num_slots: N, the slot pool.
      backend: the decode step's backend ("xla", "pallas_triton", "mosaic_gpu" or "auto").
    """

    def __init__(self, params: GDNParams, dims: GDNDims, config: ReplayConfig, num_slots: int, *,
                 backend: str = "xla"):
        heads = (dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)
        if heads != (config.num_k_heads, config.num_v_heads, config.head_k_dim, config.head_v_dim):
            raise ValueError(f"config heads {config} do not match the layer's dims {dims}")
        super().__init__(params, dims, config, num_slots, backend)

    _replay, _verify = staticmethod(gdn_replay), staticmethod(gdn_verify)
    # the prefill's chunked recurrence (UT transform, chunks of 64), as `model.decoder.prefill`
    _plain = staticmethod(functools.partial(gdn_plain, chunked=True))

    @staticmethod
    def _live(weights, state, plan):
        return xla.replay_state(state, plan)


class Mamba2DecodeLayer(_DecodeLayer):
    """One Mamba-2 layer (`model.mamba2_layer`) over `num_slots` slots with its decode state
    in NNX variables; arguments as `GDNDecodeLayer`'s (`Mamba2LayerParams`, `Mamba2Dims`, a
    "mamba2" `ReplayConfig` of H heads of dim P, state size N, G groups)."""

    def __init__(self, params: Mamba2LayerParams, dims: Mamba2Dims, config: ReplayConfig, num_slots: int, *,
                 backend: str = "xla"):
        sizes = (dims.num_groups, dims.num_heads, dims.state_size, dims.head_dim)
        if config.gate != "mamba2" or sizes != (config.num_k_heads, config.num_v_heads, config.head_k_dim,
                                                config.head_v_dim):
            raise ValueError(f"config {config} is not a Mamba-2 config of the layer's dims {dims}")
        super().__init__(params, dims, config, num_slots, backend)

    _replay, _verify = staticmethod(mamba2_replay), staticmethod(mamba2_verify)
    _plain = staticmethod(mamba2_plain)

    @staticmethod
    def _live(weights, state, plan):
        return xla.mamba2_replay_state(state, plan, ssm_params(weights).A)


class Decoder(nnx.Module):
    """The package's small decoder (`model.decoder`) with `GDNDecodeLayer`s, or for a hybrid
    stack (`config.layers`) a `GDNDecodeLayer` or `Mamba2DecodeLayer` per layer.

    Args:
      params: `model.decoder.DecoderParams` (blocks stacked over layers; a hybrid stack's
        tuple of `HybridBlock`s).
      config: `model.decoder.DecoderConfig`.
      num_slots, cache_len, state_dtype: the decode state of every layer.
      backend: the layers' decode backend.
    """

    def __init__(self, params: decoder_lib.DecoderParams, config: decoder_lib.DecoderConfig, *,
                 num_slots: int, cache_len: int, state_dtype=jnp.float32, backend: str = "xla"):
        if config.hybrid:
            blocks, mixers = list(params.blocks), [block.mixer for block in params.blocks]
            self.blocks = nnx.Param([dataclasses.replace(b, mixer=None) for b in blocks])
        else:
            blocks = [jax.tree.map(lambda a, i=i: a[i], params.blocks) for i in range(config.num_layers)]
            mixers = [block.gdn for block in blocks]
            self.blocks = nnx.Param([dataclasses.replace(b, gdn=None) for b in blocks])
        self.layers = nnx.List([
            (GDNDecodeLayer if kind == "gdn" else Mamba2DecodeLayer)(
                mixer, config.gdn if kind == "gdn" else config.mamba2,
                config.layer_replay_config(kind, cache_len, state_dtype), num_slots, backend=backend)
            for kind, mixer in zip(config.kinds, mixers)])
        self.head = nnx.Param(dataclasses.replace(params, blocks=None))

    def _blocks(self, x, run_layer):
        for layer, block in zip(self.layers, self.blocks.get_value()):
            x = x + run_layer(layer, rms_norm(x, block.attn_norm))
            x = x + decoder_lib._mlp(block, x)
        return x

    def prefill(self, tokens: Int[Array, "B T"], lengths: Int[Array, " B"], slots: Int[Array, " B"]
                ) -> Float[Array, "B V"]:
        """Logits of each row's last prompt token `[B, V]`; every layer's slot continued."""
        check_slots("slots", slots, jnp.shape(tokens)[0], self.layers[0].replay.get_value().num_slots)
        head = self.head.get_value()
        x = self._blocks(decoder_lib._embed(head, tokens), lambda layer, h: layer.prefill(h, lengths, slots))
        logits = decoder_lib._logits(head, x)
        last = jnp.take_along_axis(logits, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
        return last[:, 0]

    def decode_step(self, tokens: Int[Array, " B"], slots: Int[Array, " B"],
                    force_flush: jax.Array | None = None, *, policy: FlushPolicy | str | None = None
                    ) -> Float[Array, "B V"]:
        """One token per row through every layer under one flush plan: logits `[B, V]`."""
        state = self.layers[0].replay.get_value()
        check_slots("slots", slots, jnp.shape(tokens)[0], state.num_slots)
        batch, backend = jnp.shape(tokens)[0], self.layers[0].backend
        configs = tuple(layer.replay.get_value().config for layer in self.layers)
        policy = decoder_lib.layers_flush_policy(configs, batch, backend) if policy is None else as_policy(policy)
        plan = plan_step(state.write_pos, slots, force_flush, state.config.cache_len, policy)
        head = self.head.get_value()
        x = self._blocks(decoder_lib._embed(head, tokens), lambda layer, h: layer.decode(h, plan))
        return decoder_lib._logits(head, x)

    def verify_window(self, tokens: Int[Array, "B T"], slots: Int[Array, " B"],
                      parents: Int[Array, "B T"] | None = None
                      ) -> tuple[Float[Array, "B T V"], tuple, Bool[Array, " B"]]:
        """`model.decoder.verify_window` on the NNX state (a chain, or a tree by `parents`):
        logits `[B, T, V]` after each window token, the window's conv inputs (one `[B, T, C]`
        per layer) for `accept_window`, and the rows the capacity rule folded. Cursors do not
        move."""
        decoder_lib.check_token_ids("tokens", tokens, 2)
        before = self.layers[0].replay.get_value()
        batch, width = jnp.shape(tokens)
        check_slots("slots", slots, batch, before.num_slots)
        if width > before.config.cache_len:
            raise ValueError(f"window width T = {width} exceeds cache_len = {before.config.cache_len}")
        speculative.check_parents(parents, batch, width)
        parents = None if parents is None else jnp.asarray(parents, jnp.int32)
        head, conv_inputs = self.head.get_value(), []

        def run_layer(layer, h):
            out, inputs = layer.verify(h, slots, parents)
            conv_inputs.append(inputs)
            return out

        logits = decoder_lib._logits(head, self._blocks(decoder_lib._embed(head, tokens), run_layer))
        after = self.layers[0].replay.get_value().write_pos
        return logits, tuple(conv_inputs), decoder_lib.folded_rows(slots, before.write_pos, after)

    def accept_window(self, slots: Int[Array, " B"], num_accepted: Int[Array, " B"], conv_inputs: tuple,
                      path: Int[Array, "B P"] | None = None) -> None:
        """Keep the first `num_accepted[b]` (0..T) tokens of each row's verified window in every
        layer (a tree's along its accepted `path`; `model.decoder.accept_window`)."""
        decoder_lib.check_window_counts(num_accepted, jnp.shape(conv_inputs[0])[-2])
        path = None if path is None else jnp.asarray(path, jnp.int32)
        for layer, inputs in zip(self.layers, conv_inputs):
            layer.accept(slots, num_accepted, inputs, path)
