"""Reference models used by tests, examples and benchmarks."""

from autopart.models.gpt import GPT, GPTConfig
from autopart.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
