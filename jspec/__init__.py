"""jspec: speculative-decoding LLM inference on JAX/Pallas.

import jspec
model = jspec.load("/path/to/hf-checkpoint")        # config.json + safetensors (+ tokenizer.json), or a Hub repo id
outs = jspec.generate(model, ["Hello"], max_new_tokens=32)
print(outs[0].text, outs[0].token_ids)

engine = jspec.Engine(model, speculative=jspec.SpecConfig("EAGLE3", draft_model_path=...))
"""

from jspec.api import Model, generate, load
from jspec.config.engine import EngineConfig
from jspec.config.model import ModelConfig
from jspec.config.sampling import SamplingParams
from jspec.config.spec import SpecConfig
from jspec.engine.engine import Engine, RequestOutput
from jspec.engine.outputs import GenerationOutput

__all__ = [
    "Engine",
    "EngineConfig",
    "GenerationOutput",
    "Model",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SpecConfig",
    "generate",
    "load",
]
