"""Drafters: the neural block (DSpark, DFlash) and shifted (EAGLE-3, MTP) drafters, the copy drafters (n-gram, suffix), the router, and checkpoint formats."""
