"""The kernels room: reading GGUF files, block types and the products over them, the C++ sources and their
build, the CPU class. It imports nothing from the rest of the engine.
"""
