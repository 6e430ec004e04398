"""edgellm: low-latency LLM serving for one machine."""

from edgellm.config import EngineConfig
from edgellm.llm import LLM
from edgellm.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"
