"""What a plan costs: pure functions of shapes, placements and a ``Cluster`` (no process groups).

``cluster`` describes the machine, ``comm`` prices collectives, ``compute`` prices op calls, ``memory`` holds the
closed-form model-state, activation and FLOP counts from the literature.
"""

from autopart.cost.cluster import PRESETS, Cluster, Device, Link, Preset, preset
from autopart.cost.comm import (
    COLLECTIVES,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_time,
    exposed_after,
    hierarchical_time,
    reduce_scatter_time,
    send_recv_time,
)
from autopart.cost.compute import backward_flops, matmul_flops, node_bytes, node_flops, roofline_time
from autopart.cost.memory import (
    RECOMPUTE_MODES,
    gpt_params,
    gpt_train_flops,
    megatron_activation_bytes_per_layer,
    model_state_bytes,
)

__all__ = [
    "COLLECTIVES",
    "PRESETS",
    "RECOMPUTE_MODES",
    "Cluster",
    "Device",
    "Link",
    "Preset",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "backward_flops",
    "collective_time",
    "exposed_after",
    "gpt_params",
    "hierarchical_time",
    "gpt_train_flops",
    "matmul_flops",
    "megatron_activation_bytes_per_layer",
    "model_state_bytes",
    "node_bytes",
    "node_flops",
    "preset",
    "reduce_scatter_time",
    "roofline_time",
    "send_recv_time",
]
