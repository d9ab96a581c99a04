"""jspec: speculative-decoding LLM inference on JAX/Pallas.

    import jspec
    model = jspec.load("/path/to/hf-checkpoint")        # config.json + safetensors (+ tokenizer.json)
    outs = jspec.generate(model, ["Hello"], max_new_tokens=32)
    print(outs[0].text, outs[0].token_ids)
"""

from jspec.config import ModelConfig, SpecConfig
from jspec.generate import GenerationOutput, Model, generate, load

__all__ = ["GenerationOutput", "Model", "ModelConfig", "SpecConfig", "generate", "load"]
