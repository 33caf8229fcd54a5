"""Reference models used by tests, examples and benchmarks."""

from autopart.models.gpt import GPT, GPTConfig
from autopart.models.llama import Llama, LlamaConfig
from autopart.models.mamba import Hybrid, HybridConfig, Mamba, MambaConfig  # noqa: F401  (Mamba and hybrid)

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
