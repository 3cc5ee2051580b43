"""The C kernels and codelets seen from Python: the codelet table read from C and the
executors derived from it (`codelets.py`)."""
