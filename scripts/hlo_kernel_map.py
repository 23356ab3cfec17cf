"""Which model operation each GPU kernel of a profiled step comes from.

CUPTI names an XLA fusion's kernel after the fusion instruction (``loop_add_fusion.3`` runs as
``loop_add_fusion_3``), and XLA's optimized HLO keeps, on each instruction, the jax operation it came from and
its source position (``op_name="jit(_device_forward)/…/dot_general"``, a ``stack_frame_id`` into the module's
frame tables). This script joins the two: it reads the ``*after_optimizations.txt`` modules of an XLA dump
(``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``) and the decode kernels that ``bench_serving.py
--breakdown`` measured, picks the dumped module that names the most of the step's kernel time (the decode
program: the prefill programs reuse the same generic fusion names for other operations; a name it lacks, such as
a sampler kernel, is looked up in the others) and prints, per kernel, its ms and launches per step, the fusion
kind, the output shape, the jax operation and its source line with the calling functions.

    python3 scripts/hlo_kernel_map.py DUMP_DIR OUT/bench_serving.json [--top 60]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
from collections import Counter
from typing import NamedTuple

# "%name = <shape or (tuple of shapes)> <opcode>(": a tuple shape holds spaces, so it is matched up to its ")"
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+(fusion|custom-call|\w[\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")
_KIND = re.compile(r"kind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


class Instr(NamedTuple):
    """One instruction of an optimized HLO module that can become a kernel."""

    detail: str        # fusion kind or custom-call target
    shape: str         # output shape as printed
    op_name: str       # jax operation (name stack), "" when XLA kept none
    source: str        # "file:line function < callers", "" when absent


def kernel_name(instr_name: str) -> str:
    """The kernel name CUPTI reports for an HLO instruction named ``instr_name``."""
    return re.sub(r"[.\-]", "_", instr_name)


def stack_frames(lines: list[str]) -> dict[int, str]:
    """Stack frame id -> "file:line function < caller's function < …" from the module's ``FileNames``,
    ``FunctionNames``, ``FileLocations`` and ``StackFrames`` tables (newer XLA keeps source positions there, not
    in ``source_file`` / ``source_line``)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := _TABLE_ROW.match(line)):
            current[int(m.group(1))] = m.group(2)
        elif line.startswith(("%", "ENTRY")):
            break
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locs = {k: dict((a, int(b)) for a, b in _FIELD.findall(v)) for k, v in tables.get("FileLocations", {}).items()}
    frames = {k: dict((a, int(b)) for a, b in _FIELD.findall(v)) for k, v in tables.get("StackFrames", {}).items()}

    def where(loc_id: int) -> tuple[str, str]:
        loc = locs.get(loc_id, {})
        file = pathlib.Path(files.get(loc.get("file_name_id", -1), "?").strip('"')).name
        return f"{file}:{loc.get('line', '?')}", funcs.get(loc.get("function_name_id", -1), "?").strip('"')

    out: dict[int, str] = {}
    for fid in frames:
        chain, seen, f = [], set(), fid
        while f in frames and f not in seen and len(chain) < 4:
            seen.add(f)
            chain.append(where(frames[f].get("file_location_id", -1)))
            f = frames[f].get("parent_frame_id", -1)
        if chain:
            out[fid] = f"{chain[0][0]} {' < '.join(fn for _, fn in chain)}"
    return out


def read_module(path: pathlib.Path) -> dict[str, Instr]:
    """Kernel name -> :class:`Instr` for the fusions and custom calls of one optimized HLO text module. Instruction
    names are unique within a module, so fusions nested inside fusions (never launched alone) only add names no
    kernel carries."""
    out: dict[str, Instr] = {}
    lines = path.read_text(errors="replace").splitlines()
    frames = stack_frames(lines)
    for line in lines:
        m = _INSTR.match(line)
        if not m or m.group(3) not in ("fusion", "custom-call"):
            continue
        name, shape, _ = m.groups()
        op = _OP_NAME.search(line)
        src, frame = _SOURCE.search(line), _FRAME_ID.search(line)
        detail = (_KIND.search(line) or _TARGET.search(line))
        source = (f"{pathlib.Path(src.group(1)).name}:{src.group(2)}" if src
                  else frames.get(int(frame.group(1)), "") if frame else "")
        out[kernel_name(name)] = Instr(detail.group(1) if detail else "", shape, op.group(1) if op else "",
                                       source)
    return out


def custom_calls(module: dict[str, Instr]) -> list[tuple[Instr, int]]:
    """The module's custom calls (cuBLAS GEMMs, Mosaic GPU kernels, ...) grouped by target, shape, operation and
    source, with how many instructions each group has. CUPTI names their kernels after the library's kernels
    (``nvjet_…``, ``sm80_xmma_gemm_…``) or the kernel body, not the instruction, so the step's table cannot be
    joined to them by name; this lists what they can be matched with by kind and count."""
    groups = Counter(ins for ins in module.values() if not ins.detail.startswith("k"))
    return sorted(groups.items(), key=lambda kv: (kv[0].detail, kv[0].source, kv[0].shape))


def read_kernels(path: pathlib.Path) -> list[tuple[str, float, float]]:
    """(kernel, ms per step, launches per step) of the decode step, largest first, from ``bench_serving.json``
    (``--out`` of a ``--breakdown`` run)."""
    row = next((r for r in json.loads(path.read_text()) if r.get("decode_kernels_ms")), None)
    if row is None:
        raise SystemExit(f"no decode kernels in {path} (run bench_serving.py with --breakdown and --out)")
    launches = row.get("decode_kernel_launches") or {}
    return [(k, float(ms), float(launches.get(k, "nan"))) for k, ms in row["decode_kernels_ms"]]


def short_op(op_name: str, keep: int = 4) -> str:
    """The last ``keep`` parts of a jax name stack (the model function and the primitive)."""
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    return "/".join(parts[-keep:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump_dir", type=pathlib.Path)
    ap.add_argument("kernels", type=pathlib.Path, help="bench_serving.json of a --breakdown run (--out)")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--holds", default="", help="only modules whose text holds this string, e.g. s32[64,1]")
    args = ap.parse_args()
    kernels = read_kernels(args.kernels)
    paths = sorted(args.dump_dir.rglob("*after_optimizations.txt"))
    if args.holds:   # e.g. "s32[64,1]": the decode program's [batch, 1] token input, which no prefill program has
        paths = [p for p in paths if args.holds in p.read_text(errors="replace")]
    modules = {p: read_module(p) for p in paths}
    if not modules:
        raise SystemExit(f"no *after_optimizations.txt modules under {args.dump_dir}")
    best = max(modules, key=lambda p: (sum(ms for k, ms, _ in kernels if k in modules[p]), -len(modules[p])))
    module = modules[best]
    covered = sum(ms for k, ms, _ in kernels if k in module)
    total = sum(ms for _, ms, _ in kernels)
    print(f"module {best.name}: {len(module)} kernels; the step's table {len(kernels)} kernels, {total:.3f} ms, "
          f"{covered:.3f} ms of it named in this module")
    print("| kernel | ms/step | launches | us/launch | kind | shape | jax op | source |")
    print("|---|---:|---:|---:|---|---|---|---|")
    for k, ms, n in kernels[:args.top]:
        ins = module.get(k)
        if ins is None:   # e.g. the sampler program's kernels: the first other module naming it, marked
            other = next((p for p, m in modules.items() if k in m), None)
            if other is not None:
                ins = modules[other][k]._replace(detail=f"{modules[other][k].detail} ({other.name.split('.')[1]})")
        us = 1e3 * ms / n if n == n and n > 0 else float("nan")
        if ins is None:
            print(f"| {k[:60]} | {ms:.3f} | {n:.1f} | {us:.1f} | (not in module) | | | |")
            continue
        print(f"| {k[:60]} | {ms:.3f} | {n:.1f} | {us:.1f} | {ins.detail} | {ins.shape[:40]} | "
              f"{short_op(ins.op_name)[:90]} | {ins.source} |")
    print("\nCustom calls of the module (their kernels carry library names; an instruction inside a layer loop "
          "launches once per iteration):\n")
    print("| target | instructions | shape | jax op | source |")
    print("|---|---:|---|---|---|")
    for ins, count in custom_calls(module):
        print(f"| {ins.detail} | {count} | {ins.shape[:60]} | {short_op(ins.op_name)[:90]} | {ins.source} |")


if __name__ == "__main__":
    main()
