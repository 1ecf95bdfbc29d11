"""The verifier's runtime: architecture and loading, the decoder and its KV cache, attention, the draft
vocabulary, the CPU kernels (kernels.py, C++ in csrc/) and the GPU's captured step (graph.py); how a
weight is stored and multiplied lives in weights/."""
