"""specloop's own CPU kernels for the decode step (quantized products, attention, norms), built at run
time for this CPU.

The stock weight-only kernels (`torch._weight_int4pack_mm_for_cpu`, `torch._weight_int8pack_mm`)
compute every row of a call on its own: exact for verification, but a verify pass of 5 tokens
then streams the weights 5 times (measured: 3x a one-token step's int4 cost, 2x the int8 head's).
The kernels here read each tile of weights (64 outputs) from memory once for all rows of the call
(in chunks of 4 rows, the tile staying in L1 between chunks) and compute every row with the same
instructions in the same order whatever the number of rows, so a verify pass scores a token bit
for bit as a one-token step does, by construction:

- int4 (`q4_mm`): groups of 32 inputs, w = q · d + m with q in [0, 15] and fp16 d, m per (output,
  group) (GGUF Q4_1's own form); y[n] = Σ_g (d · Σ_{i in g} q x_i + m · Σ_{i in g} x_i), the inner sums
  in input order, the groups in order, fp32 throughout.
- int8 (`q8_mm`): per-output-channel symmetric int8, y[n] = scale[n] · Σ_i q x_i in input order.
- w4a8 (`w4a8_mm`): the int4 weights times activations rounded to int8 per row and group of 32
  (`quantized_rows`), integer dot products (AVX-512 VNNI, else AVX-512BW / AVX2 by |x| and sign),
  as llama.cpp multiplies Q4_1 by Q8_1; w8a8 (`w8a8_mm`): int8 blocks of 32 with an fp16 scale
  (GGUF Q8_0) likewise, and `w8a8_rows` looks rows of such a table up (an embedding). On a CPU with
  AVX2 but not AVX-512 these products and the attention run in explicit 8-lane registers, RMSNorm and
  SwiGLU on `vn`, the widest vector a register holds (GCC keeps the 16-lane vectors the other paths use
  in memory there): a 5-token verify pass 0.36x, a one-token step 0.68x what they cost in that vector
  code (bench/README.md sections 40 and 41). On a CPU with AMX-INT8 (Intel Xeon since Sapphire Rapids)
  products of many rows (a prompt's prefill, a batch's verify pass: w4a8 from 32 rows, w8a8 from 8) take
  their integer sums 16 rows at a time from tile products instead (`set_amx`; the same exact integers,
  then the same float steps: the same bits; bench/README.md section 60).

The decode step around them is compiled too: `attend` (RoPE, the KV write and causal attention:
every query head over the keys up to its position through the same operations whichever query heads
share its KV head's loads, so exact across T, batch and threads by construction), `rms_norm`,
`silu_mul`, and `layer` (a whole decoder layer in one call; with four w4a8 linears, the served default,
in one parallel region: the threads go through the layer's steps together, a barrier between them, each
taking an even share of every step's rows, heads and blocks of outputs, where one region a step left the
serial parts and the interpreter between steps on one thread: a one-token step 0.89x; the same bits as
the step-by-step `layer_by_ops`); `LayerStack` holds every layer's arguments so that the decoder runs a
run of layers in one call (specloop.drafter.model.decoder `LeanDecoder._stack`).

Weights are laid out in blocks of 16 outputs ([N/16, K/2, 16] nibble pairs, [N/16, K, 16] int8),
so one vector of 16 lanes computes 16 outputs, 4 blocks a tile (independent accumulator chains; w4a8's
blocks with their groups interleaved four by four where the tile is AVX-512's, which reads a tile group by
group: one stretch of memory, prefetched line by line, a 5-token verify pass 0.93-0.96x);
threads split the tiles (in a layer's region, the blocks), each output computed whole by one thread, so
the thread count changes no rounding.

The C++ lives in csrc/ beside this file: kernels.h (what the sources share, and the functions the
module exposes), weight_only.cpp (`q4_mm`, `q8_mm`), int8_dot.cpp (`w4a8_mm`, `w8a8_mm`), attention.cpp
(`attend`), layer.cpp (`rms_norm`, `silu_mul`, `layer`, the Python bindings) and region.cpp (`layer`'s
w4a8 form in one parallel region), compiled as one unit
(all.cpp includes them: torch's headers parsed once); the `#if` branches there
pick the kernels for the CPU they are compiled on. They are compiled once per CPU (`-march=native`;
torch.utils.cpp_extension.load, a build folder under torch's extension cache named by a digest of the
CPU's flags, the machine, torch, the sources' folder and text), so a compiler error names its .cpp file
and line. Where no compiler is available `available()` is False and specloop.drafter.model.weights.quant
uses the stock kernels. `_self_check()` runs at load and refuses the build (falling back likewise) unless
it computes the products and the attention it should and multi-row calls equal row-alone calls bit for
bit on this machine.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LANES = 16  # outputs per weight block (one vector of fp32 lanes)
TILE = 4  # blocks per tile in the kernels: N is padded to a multiple of LANES * TILE
GROUP = 32  # int4 group size

_CSRC = Path(__file__).with_name("csrc")
_UNIT = "all.cpp"  # includes every other .cpp: one compile unit (see its comment)


def _source_files() -> list[Path]:
    """Every file the build reads: the compile unit, the .cpp files it includes and the headers."""
    return sorted(_CSRC.glob("*.cpp")) + sorted(_CSRC.glob("*.h"))


def _cpu_digest() -> str:
    """A digest of what the build depends on: the CPU's flags, the machine, torch, and the sources (their
    folder, which the build files name, and their text)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    sources = [f"{path.name}\n{path.read_text()}" for path in _source_files()]
    text = "|".join((flags, platform.machine(), torch.__version__, str(_CSRC.resolve()), *sources))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@functools.cache
def _module():
    """The compiled extension, or None (no compiler, a failed build, or SPECLOOP_KERNELS=stock)."""
    if os.environ.get("SPECLOOP_KERNELS", "auto") == "stock":
        return None
    try:
        name = f"specloop_kernels_{_cpu_digest()}"  # in the try: an install without csrc/ falls back too
        announce_first_build(name, "its CPU kernels for this CPU (once, ~40 s)")
        mod = build(_CSRC, name)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the stock kernels
        log.warning("specloop kernels not built (%s: %s); using torch's stock int4/int8 kernels and the eager "
                    "decode step (no w4a8)", type(e).__name__, e)
        return None
    if not _self_check(mod):
        log.warning("specloop kernels failed their self-check on this CPU (wrong values, or a row rounded "
                    "differently beside other rows); using torch's stock int4/int8 kernels and the eager decode "
                    "step (no w4a8)")
        return None
    mod.set_amx(os.environ.get("SPECLOOP_AMX", "auto").lower() not in ("off", "0", "false"))
    return mod


def build(folder: Path, name: str):
    """The sources in `folder` (its all.cpp) compiled for this CPU as extension `name` (cached by name).
    `_module` builds csrc/ beside this file; bench/step_cost.py --baseline an earlier revision's, to time
    both in one process."""
    from torch.utils.cpp_extension import load

    return load(name=name, sources=[str(folder / _UNIT)], extra_cflags=["-O3", "-march=native", "-ffp-contract=fast",
                "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def announce_first_build(name: str, what: str) -> None:
    """Say so on stderr when extension `name` is not built and cached yet (a pause otherwise unexplained)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        built = any(Path(_get_build_directory(name, verbose=False)).glob("*.so"))
    except Exception:  # noqa: BLE001 - only a message depends on it
        built = True
    if not built:
        print(f"specloop: building {what}...", file=sys.stderr, flush=True)


def available() -> bool:
    return _module() is not None


def set_amx(on: bool) -> bool:
    """Whether int8 products of many rows (w4a8 from 32, w8a8 from 8) take their integer sums from AMX tiles (on
    by default where the CPU has AMX-INT8 and Linux lends the tiles to the process); off: the vector tiles alone,
    the same bits. Returns whether the tiles are used now (False without them or without the kernels).
    SPECLOOP_AMX=off turns them off when the kernels load."""
    mod = _module()
    return bool(mod.set_amx(on)) if mod is not None else False


def amx_in_use() -> bool:
    """Whether int8 products of many rows run on AMX tiles now (`set_amx`)."""
    mod = _module()
    return bool(getattr(mod, "amx_in_use", lambda: False)()) if mod is not None else False


def _self_check(mod) -> bool:
    """The build computes what it should (against a float64 product of the same weights) and every row
    count 1..9 gives each row exactly what it gets alone (the property verification needs)."""
    g = torch.Generator().manual_seed(0)
    N, K = 2 * TILE * LANES, 96
    q4 = torch.randint(0, 16, (N, K), generator=g)
    d, m = torch.rand(N, K // GROUP, generator=g).half().float(), torch.randn(N, K // GROUP, generator=g).half().float()
    q8, s = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8), torch.rand(N, generator=g)
    w4 = q4.double() * d.double().repeat_interleave(GROUP, 1) + m.double().repeat_interleave(GROUP, 1)
    w8 = q8.double() * s.double()[:, None]
    packed4, packed8 = pack_q4(q4, d, m), pack_q8(q8, s)
    x = torch.randn(9, K, generator=g)
    packed48 = pack_w4a8(q4, d, m, _interleave(mod))  # in the layout `mod` reads (not _module(): it is being built)
    b8 = torch.rand(N, K // GROUP, generator=g).half().float()  # Q8_0-style blocks: w = q · d per 32
    packed88 = pack_w8a8(q8, b8)
    w88 = q8.double() * b8.double().repeat_interleave(GROUP, 1)
    xq, dx, _ = quantized_rows(x)
    x48 = (xq.double().view(9, -1, GROUP) * dx.double()[..., None]).view(9, K)  # the activations w4a8 multiplies
    for call, w, xs in ((lambda rows: mod.q4_mm(rows, *packed4), w4, x),
                        (lambda rows: mod.q8_mm(rows, *packed8), w8, x),
                        (lambda rows: mod.w4a8_mm(rows, *packed48), w4, x48),
                        (lambda rows: mod.w8a8_mm(rows, *packed88), w88, x48)):
        alone = torch.cat([call(x[i : i + 1].contiguous()) for i in range(9)])
        exact = xs.double() @ w.t()
        if not torch.allclose(alone.double(), exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max())):
            return False
        if not all(torch.equal(call(x[:R].contiguous()), alone[:R]) for R in range(2, 10)):
            return False
    many = torch.randn(34, K, generator=g)  # 32 rows through the AMX tiles where the CPU has them, 2 not
    for call in (lambda rows: mod.w4a8_mm(rows, *packed48), lambda rows: mod.w8a8_mm(rows, *packed88)):
        if not torch.equal(call(many), torch.cat([call(r[None]) for r in many])):
            return False
    return _attention_checks(mod, g)


def _attention_checks(mod, g: torch.Generator) -> bool:
    """`attend` against a float64 softmax attention, and a 7-token pass equal bit for bit to seven
    one-token steps (rows of different lengths in one batch)."""
    B, H, Hkv, D, C = 2, 4, 2, 32, 64
    cos, sin = torch.rand(C, D, generator=g), torch.rand(C, D, generator=g)
    x = torch.randn(B, 7, (H + 2 * Hkv) * D, generator=g)
    lens = torch.tensor([0, 9])

    def run(chunks):
        kc, vc = torch.zeros(B, Hkv, C, D), torch.zeros(B, Hkv, C, D)
        outs, at = [], lens.clone()
        for part in chunks:
            outs.append(mod.attend(part, kc, vc, cos, sin, at, H, 0.3))
            at = at + part.shape[1]
        return torch.cat(outs, 1)

    whole = run([x])
    if not torch.equal(whole, run([x[:, t : t + 1] for t in range(7)])):
        return False
    half = D // 2
    rope = lambda t, p: t * cos[p, None] + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[p, None]  # noqa: E731
    for b in range(B):
        n, p = int(lens[b]), torch.arange(int(lens[b]), int(lens[b]) + 7)
        qkv = x[b].double().view(7, H + 2 * Hkv, D)
        q, k = rope(qkv[:, :H], p), rope(qkv[:, H : H + Hkv], p).repeat_interleave(H // Hkv, 1)
        v = qkv[:, H + Hkv :].repeat_interleave(H // Hkv, 1)
        k = torch.cat([k.new_zeros(n, H, D), k]).transpose(0, 1)  # [H, n + 7, D] (zero keys before: lens)
        v = torch.cat([v.new_zeros(n, H, D), v]).transpose(0, 1)
        scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * 0.3  # [H, 7, n + 7]
        scores = scores.masked_fill(torch.ones(7, n + 7, dtype=torch.bool).triu(n + 1), float("-inf"))
        ref = (scores.softmax(-1) @ v).transpose(0, 1).reshape(7, H * D)
        if not torch.allclose(whole[b].double(), ref, rtol=1e-4, atol=1e-5):
            return False
    return True


# ----------------------------------------------------------------------------- layouts


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `w4a8_mm` multiplies, computed as it does: x [R, K] fp32 → (xq [R, K] int8, dx [R, K/32],
    sx [R, K/32]) with dx = max|x| / 127 per group of 32, xq = round-half-even(x · (127 / max|x|)),
    sx = dx · Σ xq. For tests and the load-time self-check."""
    groups = x.float().view(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv[..., None]).to(torch.int8)
    dx = amax / 127.0
    return xq.view_as(x), dx, dx * xq.sum(-1, dtype=torch.int32).float()


def _padded(*per_output: torch.Tensor) -> list[torch.Tensor]:
    """Tensors of N rows each (one per output) with zero rows appended up to a multiple of one tile."""
    pad = -per_output[0].shape[0] % (LANES * TILE)
    return [torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t for t in per_output]


def _half(t: torch.Tensor) -> torch.Tensor:
    """Group scales / minimums as the kernels store them: fp16 (a GGUF's own are fp16: exact)."""
    h = t.to(torch.float16)
    if not torch.isfinite(h).all():
        raise ValueError("int4 group scales / minimums beyond fp16's range")
    return h


def pack_q4(q: torch.Tensor, scale: torch.Tensor,
            minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] integers in [0, 15], scale / minimum [N, K/32] → (nibbles [N'/16, K/2, 16] uint8,
    d, m [N'/16, K/32, 16] fp16), N' = N rounded up to 64 (zero outputs)."""
    K = q.shape[1]
    q, scale, minimum = _padded(q.to(torch.uint8), _half(scale), _half(minimum))
    pairs = q.view(-1, LANES, K // 2, 2)
    nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2).contiguous()
    lanes = lambda t: t.view(-1, LANES, t.shape[1]).transpose(1, 2).contiguous()  # noqa: E731
    return nibbles, lanes(scale), lanes(minimum)


def pack_w4a8(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              interleave: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] integers in [0, 15], scale / minimum [N, K/32] → (bytes [N'/16, K/32 · 256] uint8, d, m
    [N'/16, K/32, 16] fp16), N' = N rounded up to 64: per group, chunk j (of 4) holds for each of 16
    outputs its inputs 4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high nibbles). Blocks of 16 outputs
    come in runs of `interleave` (default: what this CPU's build reads) whose groups are interleaved
    (group 0 of each block of the run, then group 1...): the order the kernels read them in (one stream;
    csrc/int8_dot.cpp `w4a8_group`)."""
    K = q.shape[1]
    q, scale, minimum = _padded(q.to(torch.uint8), _half(scale), _half(minimum))
    G = K // GROUP
    quads = q.view(-1, LANES, G, 2, 4, 4)  # block, lane, group, half, chunk j, byte b
    packed = (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(-1, G * 256)
    lanes = lambda t: t.view(-1, LANES, G).transpose(1, 2).contiguous()  # noqa: E731
    runs = _interleave() if interleave is None else interleave
    packed = _runs(packed.view(-1, G, 256), runs).view(-1, G * 256)
    return packed, _runs(lanes(scale), runs), _runs(lanes(minimum), runs)


def _interleave(mod=None) -> int:
    """Blocks whose groups `pack_w4a8` interleaves: what this CPU's build (or `mod`) reads; 1 where none is
    built, or for a build from before the interleaving (bench/step_cost.py --baseline builds old sources)."""
    mod = _module() if mod is None else mod
    read = getattr(mod, "w4a8_interleave", None)
    return int(read()) if read is not None else 1


def _runs(t: torch.Tensor, n: int, inverse: bool = False) -> torch.Tensor:
    """[blocks, G, ...] → each run of n blocks stored group-major ([G][n]), in the same [blocks, G, ...] shape
    (`inverse`: back)."""
    if n == 1:
        return t.contiguous()
    runs = t.view(-1, t.shape[1], n, *t.shape[2:]) if inverse else t.view(-1, n, *t.shape[1:])
    return runs.transpose(1, 2).reshape(t.shape).contiguous()


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8 in [-127, 127], scale [N, K/32] (GGUF Q8_0: w = q · d) → (bytes [N'/16, K/32 · 512]
    int8, d [N'/16, K/32, 16] fp16), N' = N rounded up to 64: per group, chunk j (of 8) holds for each
    of 16 outputs its inputs 4j..4j+3."""
    K = q.shape[1]
    if int(q.min()) < -127:
        raise ValueError("int8 blocks need q in [-127, 127]")
    q, scale = _padded(q.to(torch.int8), _half(scale))
    G = K // GROUP
    packed = q.view(-1, LANES, G, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, G * 512)
    return packed.contiguous(), scale.view(-1, LANES, G).transpose(1, 2).contiguous()


def w8a8_rows(packed: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of the weight `pack_w8a8` packed, as q · d in fp32 → [*ids.shape, K]:
    an embedding lookup from the blocks, without a float copy of the table; one compiled call where the
    kernels are built (the step's embedding: ten small ops, ~0.15 ms on 2 cores), else `w8a8_rows_by_ops`."""
    mod = _module()
    if mod is None or ids.device.type != "cpu":
        return w8a8_rows_by_ops(packed, d, ids)
    return mod.w8a8_rows(packed, d, ids)


def w8a8_rows_by_ops(packed: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`w8a8_rows` in torch ops: the same values (q · d, one fp32 product each)."""
    G = d.shape[1]
    flat = ids.reshape(-1)
    block, lane = flat // LANES, flat % LANES
    q = packed.view(-1, G, 8, LANES, 4)[block, :, :, lane]  # [n, G, 8, 4]
    scale = d[block, :, lane].float()  # [n, G]
    rows = q.float().view(-1, G, GROUP) * scale[..., None]
    return rows.view(*ids.shape, G * GROUP)


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """specloop.drafter.decode.sampling.sample's draws (probs [N, V] fp32 on the CPU, u [N]) in one compiled call, the
    same bits; None where the kernels are not built."""
    mod = _module()
    return None if mod is None else mod.sample_rows(probs, u)


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Greedy picks in one compiled call (logits [B, V] fp32 on the CPU): (each row's first maximal index [B], its
    softmax probability [B]); None where a row holds a NaN or no finite maximum, or the kernels are not built
    (specloop.drafter.kinds.eagle.pick_greedy then takes torch's ops)."""
    mod = _module()
    fn = None if mod is None else getattr(mod, "greedy_rows", None)  # an earlier revision's build has none
    if fn is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    out = fn(logits)
    return (out[0], out[1]) if out else None


def rejection_rows(logits: torch.Tensor, t: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
                   u: torch.Tensor, limit: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Steps' verdicts in one compiled call (logits [B, k + 1, V] fp32 on the CPU, t [B] each row's temperature, 0:
    greedy; drafts [B, k], k = 0 for a plain step; q [B, k, V] fp32 or None: one-hot on the drafts; u [B, k + 1],
    limit [B] or None): (tokens [B, k + 1], accepted [B]); None where a row's logits hold a NaN or no finite maximum,
    a draft is out of the vocabulary, or the kernels are not built (specloop.drafter.decode.rejection.compiled_verdict).
    """
    mod = _module()
    fn = None if mod is None else getattr(mod, "rejection_rows", None)  # an earlier revision's build has none
    if fn is None:
        return None
    none = torch.empty(0)
    tokens, accepted, every_row = fn(logits, t, drafts, none if q is None else q, u,
                                     none.long() if limit is None else limit)
    return (tokens, accepted) if every_row else None


def w8a8_mm(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [R, K] → [R, N'] fp32 (`pack_w8a8`'s layout): int8 blocks times int8 activations."""
    return _module().w8a8_mm(x, packed, d)


def w8a8_choose(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor,
                n: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`w8a8_linear` (x [..., K] -> [..., n]) and each row's argmax over its n outputs, found while each thread's
    outputs are in its cache (numpy's argmax: the first of equal maxima; None where a row holds a NaN: the caller
    reads it from the logits); None from a build that has no such call (an earlier revision's)."""
    fn = getattr(_module(), "w8a8_choose", None)
    if fn is None:
        return None
    y, choices, every_row = fn(x, packed, d, n)
    return y, (choices if every_row else None)


def unpack_w4a8(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, N: int, interleave: int | None = None):
    """`pack_w4a8`'s inverse: (q [N, K] uint8, scale [N, K/32], minimum [N, K/32])."""
    G, runs = d.shape[1], _interleave() if interleave is None else interleave
    packed = _runs(packed.view(-1, G, 256), runs, inverse=True)
    d, m = _runs(d, runs, inverse=True), _runs(m, runs, inverse=True)
    b = packed.view(-1, G, 4, LANES, 4)  # block, group, chunk, lane, byte
    q = torch.stack([b & 15, b >> 4], dim=2)  # block, group, half, chunk, lane, byte
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(-1, G * GROUP)[:N]
    rows = lambda t: t.transpose(1, 2).reshape(-1, G)[:N]  # noqa: E731
    return q, rows(d), rows(m)


def w4a8_mm(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [R, K] → [R, N'] fp32 (`pack_w4a8`'s layout): int4 weights times int8 activations."""
    return _module().w4a8_mm(x, packed, d, m)


def unpack_q4(nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor, N: int):
    """`pack_q4`'s inverse: (q [N, K] uint8, scale [N, K/32], minimum [N, K/32])."""
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1)  # [N'/16, K/2, 16, 2]
    q = q.permute(0, 2, 1, 3).reshape(-1, nibbles.shape[1] * 2)[:N]
    rows = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1])[:N]  # noqa: E731
    return q, rows(d), rows(m)


def pack_q8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scales [N] → ([N'/16, K, 16] int8, [N'/16, 16] fp32), N' = N rounded up to 64."""
    K = q.shape[1]
    q, scales = _padded(q, scales.float())
    return q.view(-1, LANES, K).transpose(1, 2).contiguous(), scales.view(-1, LANES).contiguous()


def q4_mm(x: torch.Tensor, nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [R, K] → [R, N'] fp32 (`pack_q4`'s layout)."""
    return _module().q4_mm(x, nibbles, d, m)


def q8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [R, K] → [R, N'] fp32 (`pack_q8`'s layout)."""
    return _module().q8_mm(x, q, scales)


def attend(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           lens: torch.Tensor, n_heads: int, scale: float) -> torch.Tensor:
    """One layer's attention for T new tokens per row, in one call: qkv [B, T, (H + 2 H_kv) D] → RoPE
    (rotate half; cos / sin [P, D] fp32) on queries and keys at positions lens[b] + t, keys and values
    written into the cache (kc / vc [B, H_kv, C, D] fp32), causal attention → [B, T, H D] fp32.

    Exact by construction: each query head is computed alone over keys 0 .. its position (scores
    one dot product per key with the lanes summed in a fixed tree, an exact max, exp by one
    polynomial, the values summed key by key in order), so a token's output is the same bits
    whatever T, the batch, the other rows' lengths or the thread count."""
    return _module().attend(qkv, kc, vc, cos, sin, lens, n_heads, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (a multiple of 16), computed in fp32, each row alone."""
    return _module().rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 I] (gate, then up), computed in fp32."""
    return _module().silu_mul(gate_up)


def layer(*args) -> torch.Tensor:
    """A whole decoder layer in one call (specloop.drafter.model.decoder builds the arguments:
    `LeanDecoder._layer_args`)."""
    return _module().layer(*args)


def head_draft_op():
    """The eagle head's draft in one call, `head_draft(z, e, norms, eps, kinds, dims, parts) -> [z', logits]`
    (csrc/layer.cpp: the head's norms, four linears and SwiGLU by the functions its ops path calls), or None without
    the kernels or from a build that has none (an earlier revision's, bench/kernels_at.py)."""
    return getattr(_module(), "head_draft", None) if available() else None


def layer_stack(in_norms: list, post_norms: list, args: list, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                n_heads: int, scale: float):
    """Layers' `layer` arguments held once (`args`: each layer's (kinds, widths, packed tensors)): its
    `forward(x, keys, values, lens, first)` runs layers first.. (one per cache given) in one call; None from a
    build that has none (an earlier revision's, bench/kernels_at.py): the decoder then calls `layer` a layer."""
    make = getattr(_module(), "LayerStack", None)
    if make is None:
        return None
    kinds, dims, parts = (list(a) for a in zip(*args))
    return make(in_norms, post_norms, kinds, dims, parts, cos, sin, eps, n_heads, scale)


def linear_op(kind: str):
    """The compiled `q4_linear` / `q8_linear`: x [..., K] → [..., n] in x's dtype, in one call (what a
    decode step calls ~120 times: no Python between the conversions and the product)."""
    return getattr(_module(), f"{kind}_linear")
