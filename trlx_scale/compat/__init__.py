"""Version-guarded workarounds for places where TRL or vLLM leave no hook. Each module names the versions it covers,
and tests/test_compat.py fails when upstream changes so that the workaround can be revisited or removed."""
