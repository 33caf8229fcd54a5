"""Legal sharding options per ATen op (see ``registry``); importing this package registers every rule."""

from autopart.strategy import matrix, moe, nn, pointwise, ssm, views  # noqa: F401  (registration side effects)
from autopart.strategy.registry import NodeInfo, OpOption, Option1D, options_for, register, rule_for, tensor_inputs

__all__ = ["NodeInfo", "OpOption", "Option1D", "options_for", "register", "rule_for", "tensor_inputs"]
