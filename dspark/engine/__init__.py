"""The serving engine: requests, scheduler, runners (plain, speculative), the gate, the profiler and the engine loop."""
