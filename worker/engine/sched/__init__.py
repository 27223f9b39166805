"""The iteration-level scheduler: which requests run this step and how many tokens each
computes (admission, preemption, the running walk), the batch's counters as arrays, the
schedule's output, and applying a step's tokens back. Imports ``kv`` and the request;
never the runner or the sampler.
"""
