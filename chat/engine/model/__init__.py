"""The model room: loading a model, its architecture, the runner and the own decoder, attention, prefill,
sampling and the C++ decode step's glue. It imports nothing from the serving core (``..core``).
"""
