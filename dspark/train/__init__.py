"""Training: corpus, tokenizer, target and drafters, with exact resume."""
