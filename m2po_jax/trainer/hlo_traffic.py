"""Bytes a compiled TPU program moves to and from HBM, read from its optimized HLO.

    moved = hbm_bytes(compiled.as_text())

XLA's cost analysis ("bytes accessed") counts every operand and result of every
instruction wherever it lives. On a TPU the compiler stages weights into on-chip VMEM
(`copy-start` / `slice-start` into a layout with memory space `S(1)`) and the matmul
fusions then read that copy: the cost analysis counts the weights three to four times
(the copy's read and write, each consumer's read), where HBM serves them once. A decode
step is bound by HBM bandwidth, so its roofline wants the HBM figure:

- every instruction of the entry computation and of control-flow bodies (a loop body
  once, as the cost analysis counts it): its operands and results whose layout is not
  on chip (no `S(n)`, n >= 1);
- an async copy or slice into VMEM: the bytes it reads from HBM;
- a slice, dynamic slice or gather (alone or the only use of a fusion's operand): the bytes
  it takes, not the whole operand;
- an in-place update (dynamic-update-slice or scatter, alone or a fusion's root): the
  update's bytes, read and written, not the buffer it updates;
- Mosaic kernels (`tpu_custom_call`): nothing (their operands are whole buffers they read
  a part of; the caller adds what they read).
"""

from __future__ import annotations

import collections
import dataclasses
import re

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
             "s4": 0.5, "u4": 0.5}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([0-9,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_ON_CHIP = re.compile(r"S\([1-9]\)")

# Instructions that move no data themselves (or whose bodies are counted instead).
_NO_TRAFFIC = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "iota",
    "partition-id", "replica-id", "opt-barrier", "while", "conditional", "call",
    "copy-done", "slice-done", "all-gather-done", "all-reduce-done", "collective-permute-done",
    "send-done", "recv-done",
}  # fmt: skip
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}  # the update's operand index


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    op: str
    operands: list[str]
    line: str


def _arrays(shape: str) -> list[tuple[float, bool]]:
    """(bytes, on chip) of each array of an HLO shape string."""
    out = []
    for m in _ARRAY.finditer(shape):
        size = _ITEMSIZE[m.group(1)]
        for dim in m.group(2).split(","):
            size *= int(dim) if dim else 1
        out.append((size, bool(_ON_CHIP.search(m.group(3) or ""))))
    return out


def _in_hbm(shape: str) -> float:
    return sum(size for size, on_chip in _arrays(shape) if not on_chip)


def _parse(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """({computation: its instructions}, the entry computation's name)."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
            m = _COMPUTATION.match(line)
            if m:
                current = m.group(1)
                computations[current] = []
                entry = current if line.startswith("ENTRY") else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line) if current else None
        if m:
            name, shape, op, rest = m.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
            computations[current].append(_Instruction(name, shape, op, operands, line))
    return computations, entry


def _control_flow(computations, entry: str) -> set[str]:
    """The entry and the bodies, conditions and branches it runs (not fusions' insides)."""
    found = {entry}
    for instructions in computations.values():
        for i in instructions:
            found |= set(re.findall(r"(?:body|condition)=%([\w.\-]+)", i.line))
            if i.op == "call":
                found |= set(re.findall(r"to_apply=%([\w.\-]+)", i.line))
            branches = re.search(r"branch_computations=\{([^}]*)\}", i.line)
            if branches:
                found |= set(re.findall(r"%([\w.\-]+)", branches.group(1)))
    return found


def _fusion(i: _Instruction, body: list[_Instruction], shapes: dict) -> float:
    """HBM bytes of one fusion: its operands as its body uses them, its result."""
    root = next((b for b in body if b.line.lstrip().startswith("ROOT")), None)
    aliased = None
    if root is not None and root.op in _IN_PLACE:  # updates its operand 0 in place
        aliased = root.operands[0]
        moved = _in_hbm(shapes.get(root.operands[_IN_PLACE[root.op]], ""))
    else:
        moved = _in_hbm(i.shape)
    users = collections.defaultdict(list)
    for b in body:
        for operand in b.operands:
            users[operand].append(b)
    for b in body:
        if b.op != "parameter" or b.name == aliased:
            continue
        index = int(re.search(r"parameter\((\d+)\)", b.line).group(1))
        operand = shapes.get(i.operands[index], "") if index < len(i.operands) else ""
        if not _in_hbm(operand):
            continue
        uses = users[b.name]
        if uses and all(u.op in _SLICING and u.operands[0] == b.name for u in uses):
            moved += sum(_in_hbm(u.shape) for u in uses)
        else:
            moved += _in_hbm(operand)
    return moved


def _instruction(i: _Instruction, computations, shapes: dict) -> float:
    """HBM bytes one instruction reads and writes (the module doc's rules)."""
    if i.op in _NO_TRAFFIC or (i.op == "custom-call" and "tpu_custom_call" in i.line):
        return 0.0
    if i.op in ("copy-start", "slice-start"):
        arrays = _arrays(i.shape)  # copy-start: (dst, src, ctx); slice-start: ((src), dst, ctx)
        size, on_chip = arrays[0] if i.op == "copy-start" else arrays[1]
        source_in_hbm = bool(_in_hbm(shapes.get(i.operands[0], ""))) if i.operands else False
        return size * source_in_hbm + size * (not on_chip)
    if i.op == "fusion":
        body = computations.get(re.search(r"calls=%([\w.\-]+)", i.line).group(1), [])
        return _fusion(i, body, shapes)
    if i.op in _IN_PLACE:
        return 2 * _in_hbm(shapes.get(i.operands[_IN_PLACE[i.op]], ""))
    if i.op in _SLICING:
        taken = _in_hbm(i.shape)
        return taken * bool(_in_hbm(shapes.get(i.operands[0], ""))) + taken
    return sum(_in_hbm(shapes.get(a, "")) for a in i.operands) + _in_hbm(i.shape)


def hbm_bytes(hlo_text: str) -> float:
    """Bytes one run of the compiled program (`compiled.as_text()`) reads from and writes
    to HBM per device, by the module doc's rules; 0 for a text with no entry computation."""
    computations, entry = _parse(hlo_text)
    if not entry:
        return 0.0
    shapes = {i.name: i.shape for body in computations.values() for i in body}
    return sum(
        _instruction(i, computations, shapes)
        for name in _control_flow(computations, entry)
        for i in computations.get(name, [])
    )
