"""Files and text: llm.c's checkpoint, token-shard and tokenizer formats (`formats.py`), GPT-2
BPE (`tokenizer.py`), the bundled corpus (`corpus.py`), shards and the batch loader (`data.py`),
and the one atomic write they all use (`atomic.py`). Nothing here needs StarPU."""
