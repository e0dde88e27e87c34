"""The remote engine: the same interface over an OpenAI-compatible backend (vLLM, llama.cpp's server, ...).
It imports nothing from the local engine's rooms.
"""
