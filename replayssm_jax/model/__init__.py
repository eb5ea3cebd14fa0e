"""Multi-layer ReplaySSM: the model state, slot operations, a GDN layer and a Mamba-2 layer, a
small decoder (GDN or hybrid GDN + Mamba-2 stacks) and a continuous-batching engine."""

from replayssm_jax.model.state import (
    HybridLayer,
    HybridState,
    ModelState,
    Snapshot,
    init_hybrid_state,
    init_model_state,
    layer_state,
)
from replayssm_jax.model.slots import copy_slots, flush_slots, reset_slots, snapshot, track_flush
from replayssm_jax.model.layer import GDNDims, GDNParams
from replayssm_jax.model.decoder import (
    DecoderConfig,
    DecoderParams,
    HybridBlock,
    accept_window,
    init_params,
    layer_gate_params,
    verify_window,
)
from replayssm_jax.model.serving import Engine, Request

__all__ = [
    "DecoderConfig",
    "DecoderParams",
    "Engine",
    "GDNDims",
    "GDNParams",
    "HybridBlock",
    "HybridLayer",
    "HybridState",
    "ModelState",
    "Request",
    "Snapshot",
    "accept_window",
    "copy_slots",
    "flush_slots",
    "init_hybrid_state",
    "init_model_state",
    "init_params",
    "layer_gate_params",
    "layer_state",
    "reset_slots",
    "snapshot",
    "track_flush",
    "verify_window",
]
