"""Multi-layer ReplaySSM: the model state, slot operations, a GDN layer, a small decoder and
a continuous-batching engine."""

from replayssm_jax.model.state import ModelState, Snapshot, init_model_state, layer_state
from replayssm_jax.model.slots import copy_slots, flush_slots, reset_slots, snapshot, track_flush
from replayssm_jax.model.layer import GDNDims, GDNParams
from replayssm_jax.model.decoder import DecoderConfig, DecoderParams, accept_window, init_params, verify_window
from replayssm_jax.model.serving import Engine, Request

__all__ = [
    "DecoderConfig",
    "DecoderParams",
    "Engine",
    "GDNDims",
    "GDNParams",
    "ModelState",
    "Request",
    "Snapshot",
    "accept_window",
    "copy_slots",
    "flush_slots",
    "init_model_state",
    "init_params",
    "layer_state",
    "reset_slots",
    "snapshot",
    "track_flush",
    "verify_window",
]
