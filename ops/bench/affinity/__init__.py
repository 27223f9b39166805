"""Benchmarks of prefix affinity: which worker a conversation's next turn lands on, on a real
``ferry up`` stack (see ``ops/bench/README.md``)."""
