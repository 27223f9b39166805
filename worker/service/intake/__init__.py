"""The intake: fair pulls from the request streams into admissions, prompts built off the
engine loop, how many entries may be taken now, the reaper's takeovers, dead letters,
and the fair share's second charge.
"""
