"""drafter/model/kv_cache.py: the KV pool's memory (prefills: tests/drafter/model/test_decoder.py)."""
import subprocess
import sys

import torch

from specloop.drafter.model.kv_cache import untouched_zeros

# in a process of its own: nothing else allocates while its resident memory is read
GROWTH = """
import torch
from specloop.drafter.model.kv_cache import untouched_zeros

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before = rss()
pools = [{make} for _ in range(20)]  # 4 slots of 8,192 positions, 25 MB a layer's keys: 503 MB in all
print(rss() - before)
"""


def _growth(make: str) -> int:
    out = subprocess.run([sys.executable, "-c", GROWTH.format(make=make)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_a_pool_holds_no_memory_until_written():
    assert _growth('untouched_zeros((4, 3, 8192, 64), torch.float32, torch.device("cpu"))') < 64 << 20
    assert _growth("torch.zeros(4, 3, 8192, 64)") > 400 << 20  # what it replaced: all of it at once


def test_a_pool_is_zeros_that_write_as_any_tensor():
    shape = (4, 3, 8192, 64)
    t = untouched_zeros(shape, torch.float32, torch.device("cpu"))
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous() and t.data_ptr() % 64 == 0
    assert not t[:, :, :100].any() and not t[3, 2, -1].any()
    t[1, 2, 5:7] = 1.5  # writes land where a tensor's would
    assert float(t.sum()) == 2 * 64 * 1.5 and float(t[1, 2, 5, 0]) == 1.5
    half = untouched_zeros((2, 16), torch.bfloat16, torch.device("cpu"))
    assert half.dtype == torch.bfloat16 and not half.any() and half.data_ptr() % 64 == 0
