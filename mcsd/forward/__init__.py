"""A model with its cache: the own Llama forward, static caches, CUDA graphs, attention, q4 and native kernels."""
