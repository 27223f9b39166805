"""The lean CPU path: a direct forward for Llama-shaped layers, linear layers on oneDNN
with weights packed at load, the row counts where that pays (measured at load), and
small steps on one thread.
"""
