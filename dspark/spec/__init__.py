"""Speculative decoding: verification, policies, acceptance statistics, step-cost profile, calibration."""
