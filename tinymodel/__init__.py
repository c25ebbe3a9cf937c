"""The tiny MiMo-V2 checkpoint factory used by the CLI, the benchmarks and the tests.

  checkpoint   TinyCheckpointSpec, the constructed weights, tokenizer and golden
               continuations, and the atomic checkpoint cache (DEFAULT_CACHE)
  sizing       the per-machine probe that picks the tiny model's depth, width and dtype

It imports nothing of rollout, cluster or loadtests.
"""
