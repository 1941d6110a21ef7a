"""dspark: confidence-scheduled speculative decoding with semi-autoregressive drafting.

The public API is `LLM` and `SamplingParams`; see README.md for the command line.
"""

from dspark.config import EngineConfig, ModelConfig
from dspark.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ModelConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily so `import dspark` stays light
        from dspark.llm import LLM

        return LLM
    raise AttributeError(name)
