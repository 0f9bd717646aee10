"""HBM bytes of a compiled program by hand-computed values (the module doc's rules)."""

from m2po_jax.trainer import hlo_traffic

HLO = """HloModule probe, entry_computation_layout={()->()}

%fused_scatter (p0: bf16[8,4], p1: s32[2,1], p2: bf16[2,4]) -> bf16[8,4] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = s32[2,1]{1,0} parameter(1)
  %p2 = bf16[2,4]{1,0} parameter(2)
  ROOT %scatter.1 = bf16[8,4]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1}
}

%fused_slice (q0: f32[100,10]) -> f32[5,10] {
  %q0 = f32[100,10]{1,0} parameter(0)
  %c = s32[] constant(3)
  ROOT %ds = f32[5,10]{1,0} dynamic-slice(%q0, %c, %c), dynamic_slice_sizes={5,10}
}

%fused_dot (r0: bf16[16,32], r1: bf16[32,8]) -> f32[16,8] {
  %r0 = bf16[16,32]{1,0} parameter(0)
  %r1 = bf16[32,8]{1,0:T(8,128)S(1)} parameter(1)
  ROOT %dot.2 = f32[16,8]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (s: (s32[], f32[64])) -> (s32[], f32[64]) {
  %s = (s32[], f32[64]{0}) parameter(0)
  %v = f32[64]{0} get-tuple-element(%s), index=1
  %n = s32[] get-tuple-element(%s), index=0
  %twice = f32[64]{0} add(%v, %v)
  ROOT %out = (s32[], f32[64]{0}) tuple(%n, %twice)
}

%cond (s: (s32[], f32[64])) -> pred[] {
  %s = (s32[], f32[64]{0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main.1_spmd (w: bf16[32,8], x: bf16[16,32], pool: bf16[8,4], idx: s32[2,1], upd: bf16[2,4], big: f32[100,10], loop: (s32[], f32[64])) -> f32[16,8] {
  %w = bf16[32,8]{1,0:T(8,128)} parameter(0)
  %x = bf16[16,32]{1,0} parameter(1)
  %pool = bf16[8,4]{1,0} parameter(2)
  %idx = s32[2,1]{1,0} parameter(3)
  %upd = bf16[2,4]{1,0} parameter(4)
  %big = f32[100,10]{1,0} parameter(5)
  %loop = (s32[], f32[64]{0}) parameter(6)
  %copy-start = (bf16[32,8]{1,0:T(8,128)S(1)}, bf16[32,8]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%w)
  %copy-done = bf16[32,8]{1,0:T(8,128)S(1)} copy-done(%copy-start)
  %fusion = f32[16,8]{1,0} fusion(%x, %copy-done), kind=kOutput, calls=%fused_dot
  %scatter_fusion = bf16[8,4]{1,0} fusion(%pool, %idx, %upd), kind=kCustom, calls=%fused_scatter
  %slice_fusion = f32[5,10]{1,0} fusion(%big), kind=kLoop, calls=%fused_slice
  %kernel = f32[16,8]{1,0} custom-call(%big), custom_call_target="tpu_custom_call"
  %while = (s32[], f32[64]{0}) while(%loop), condition=%cond, body=%body
  ROOT %sum = f32[16,8]{1,0} add(%fusion, %kernel)
}
"""


def test_each_rule_by_hand():
    # copy-start of the weights into VMEM: their 512 bytes read once from HBM.
    # the dot fusion: x from HBM (1,024), the weights' VMEM copy (0), its result (512).
    # the in-place scatter: indices (8) and updates (16) read, the updates written (16).
    # the slice fusion: the 5 x 10 floats it takes (200), its result (200).
    # the Mosaic kernel: 0. The loop body once: add reads 2 x 256, writes 256.
    # the root add: 512 + 512 read, 512 written.
    want = 512 + (1024 + 512) + (8 + 16 + 16) + (200 + 200) + 0 + 768 + 1536
    assert hlo_traffic.hbm_bytes(HLO) == want


def test_on_chip_results_and_operands_are_not_counted():
    on_chip = HLO.replace("%sum = f32[16,8]{1,0} add", "%sum = f32[16,8]{1,0:S(1)} add")
    assert hlo_traffic.hbm_bytes(HLO) - hlo_traffic.hbm_bytes(on_chip) == 512
    # The weights staged from VMEM instead: the copy reads nothing from HBM.
    staged = HLO.replace("%w = bf16[32,8]{1,0:T(8,128)}", "%w = bf16[32,8]{1,0:T(8,128)S(1)}")
    assert hlo_traffic.hbm_bytes(HLO) - hlo_traffic.hbm_bytes(staged) == 512


def test_no_entry_computation_is_zero():
    assert hlo_traffic.hbm_bytes("") == 0.0
