"""The target runtime: Qwen3/Llama decoders, paged attention, loader and tokenizer."""
