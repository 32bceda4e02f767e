"""Mixing stage: interleave per-source document streams into one stream by weight.

``mix.py`` holds the weighted sampler node and the token-budget split between sources;
``schedule.py`` compiles mixture schedules (weights that change with the step) from config.
Both only decide *which* source the next document comes from; they never change a document.
"""
