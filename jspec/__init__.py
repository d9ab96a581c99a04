"""jspec: speculative-decoding LLM inference on JAX/Pallas."""
