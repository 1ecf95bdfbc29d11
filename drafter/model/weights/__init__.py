"""How a weight is stored and multiplied: plain and quantized linears (linears.py, own_linears.py), the
serving modes and the checkpoint's manifest (modes.py), GGUF groups (groups.py), quantizing a model (quant.py)."""
