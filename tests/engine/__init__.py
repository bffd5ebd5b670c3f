"""Tests of the colocated vLLM engine: each component alone, then the engine with a real vLLM CPU engine."""
