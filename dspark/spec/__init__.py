"""The speculative-decoding mathematics: verification, policies, acceptance statistics, the step-cost profile and STS calibration (pure functions and small state; no engine)."""
