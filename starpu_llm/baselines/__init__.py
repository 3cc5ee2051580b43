"""PyTorch models of the same GPT-2 (torch is a test and bench dependency only; nothing in the
runtime package imports these).

torch_gpt2: every layer written out as llm.c computes it, the tests' numerical oracle.
torch_sdpa: GPT-2 as a PyTorch user writes it for speed on a CPU (SDPA, fused AdamW): the
bench's and the figures' "PyTorch eager" series.
"""
