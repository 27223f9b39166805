"""The lean CPU path: a direct forward for the decoder layers the common families share
(one description per family, ``layer_plan.py``), linear layers on oneDNN with weights
packed at load, the row counts where that pays (measured at load), and small steps on
one thread.
"""
