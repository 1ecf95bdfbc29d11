"""specloop's drafting and decoding core."""
import os

# MKL (torch's CPU BLAS) may round a product differently depending on its operands' memory alignment
# (seen on AMD EPYC: the same fp32 weights, loaded two ways, gave different logits). Exact
# verification needs a product to depend on its values and shape alone: strict conditional numerical
# reproducibility keeps MKL's fastest code path for this CPU and drops the alignment dependence. It is
# read when MKL first runs, so it is set here, before any product; a user's own MKL_CBWR wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
