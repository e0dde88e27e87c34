"""The serving core: the local engine's loop, its scheduler and slots, prompts, grammars, drafts, decoding.

It decides and keeps request state; the model room (``..model``) runs the forwards it plans.
"""
