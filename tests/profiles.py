"""Synthetic performance-model profiles for tests: every cost zero unless given."""

from chameleon_ext.planning.perf_model import ModelShape, Profile


def synthetic_profile(shape: ModelShape, **costs) -> Profile:
    fields = dict(source="offline", device="synthetic", shape=shape, layer_fwd_ms=0.0,
                  layer_bwd_input_ms=0.0, layer_bwd_weight_ms=0.0, embedding_fwd_ms=0.0,
                  embedding_bwd_ms=0.0, head_fwd_ms=0.0, head_bwd_ms=0.0,
                  optimizer_ms_per_mparam=0.0, p2p_alpha_ms=0.0, p2p_ms_per_mib=0.0,
                  allreduce_alpha_ms=0.0, allreduce_ms_per_mib=0.0)
    return Profile(**{**fields, **costs})
