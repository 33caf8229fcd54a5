"""Reference models used by tests, examples and benchmarks."""

from autopart.models.gpt import GPT, GPTConfig
from autopart.models.llama import Llama, LlamaConfig
from autopart.models.mamba import Hybrid, HybridConfig, Mamba, MambaConfig  # noqa: F401  (Mamba and hybrid)
from autopart.models.moe import MoE, MoEConfig  # noqa: F401  (mixture of experts)

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
