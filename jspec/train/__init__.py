"""Training draft heads for speculative decoding (eagle3.py) and the prompt set they learn from (prompts.py)."""
