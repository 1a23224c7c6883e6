"""Kernel tests: TRITON_INTERPRET and the interpreter fix are set up in tests/conftest.py."""
