"""Baselines the benchmarks compare against (need torch, a test/bench-only dependency).

torch_sdpa: GPT-2 as a PyTorch user would write it for speed on a CPU (the bench's and the
figures' "PyTorch eager" series). The readable model, starpu_llm.torch_gpt2, stays the tests'
oracle.
"""
