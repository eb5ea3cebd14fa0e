"""replayssm-jax: ReplaySSM decode for Gated DeltaNet / KDA / Mamba-2 layers in JAX and Pallas."""

from replayssm_jax.checks import checked
from replayssm_jax.config import ReplayConfig
from replayssm_jax.decode import decode_step, layer_step, materialize_state
from replayssm_jax.gates import GATES, GateKind
from replayssm_jax.gating import beta_gate, gdn_gate, kda_gate, l2norm
from replayssm_jax.plan import FlushPolicy, StepPlan, advance_write_pos, default_flush_policy, plan_step
from replayssm_jax.reference import mamba2_reference, recurrent_reference
from replayssm_jax.speculative import accept, verify_step
from replayssm_jax.state import ReplayState, init_state
from replayssm_jax.tokens import Mamba2Params, Mamba2Tokens, Tokens

__all__ = [
    "GATES",
    "FlushPolicy",
    "GateKind",
    "Mamba2Params",
    "Mamba2Tokens",
    "ReplayConfig",
    "ReplayState",
    "StepPlan",
    "Tokens",
    "accept",
    "advance_write_pos",
    "beta_gate",
    "checked",
    "decode_step",
    "default_flush_policy",
    "gdn_gate",
    "init_state",
    "kda_gate",
    "l2norm",
    "layer_step",
    "mamba2_reference",
    "materialize_state",
    "plan_step",
    "recurrent_reference",
    "verify_step",
]
