"""The proof of a swap, whole: a fixed load against the server ``launch`` starts (``--load``), the
answers and tokens per second it measured, and ``compare`` of two such runs."""
