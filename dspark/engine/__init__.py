"""The serving engine: requests, scheduler, flat-batch runner and the engine loop."""
