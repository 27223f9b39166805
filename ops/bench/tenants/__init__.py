"""Benchmarks of tenant isolation and fair share on the real stack: a late tenant's share,
the fair pull's Redis cost, the prefix cache as a timing oracle, a tokenizer flood. They
may import the service benchmarks' helpers (``ops.bench.service``)."""
