"""scripts/hlo_kernel_map.py on a hand-written optimized-HLO excerpt: kernel names as CUPTI prints them, fusion
kinds, custom-call targets, source positions from metadata and from the stack-frame tables, and the custom calls
grouped for matching by kind."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import hlo_kernel_map as hkm  # noqa: E402

GEMM_META = 'metadata={op_name="jit(_device_forward)/moe/dot_general" stack_frame_id=2}'
ADD_META = ('metadata={op_name="jit(_device_forward)/add" source_file="/repo/dinfer_jax/models/mhc.py" '
            'source_line=104}')
MODULE = """HloModule jit__device_forward

FileNames
1 "/repo/dinfer_jax/models/ops.py"

FunctionNames
1 "linear_f32"
2 "router"

FileLocations
1 {file_name_id=1 function_name_id=1 line=102}
2 {file_name_id=1 function_name_id=2 line=59}

StackFrames
1 {file_location_id=2 parent_frame_id=-1}
2 {file_location_id=1 parent_frame_id=1}

%fused_add (p0: f32[64,8]) -> f32[64,8] {
  %p0 = f32[64,8]{1,0} parameter(0)
  ROOT %add.1 = f32[64,8]{1,0} add(%p0, %p0)
}

ENTRY %main (x: f32[64,256], w: f32[8,256]) -> f32[64,8] {
  %x = f32[64,256]{1,0} parameter(0)
  %w = f32[8,256]{1,0} parameter(1)
  %custom-call.3 = (f32[64,8]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", {GEMM_META}
  %custom-call.4 = (f32[64,8]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", {GEMM_META}
  %gte = f32[64,8]{1,0} get-tuple-element(%custom-call.3), index=0
  ROOT %loop_add_fusion.3 = f32[64,8]{1,0} fusion(%gte), kind=kLoop, calls=%fused_add, {ADD_META}
}
""".replace("{GEMM_META}", GEMM_META).replace("{ADD_META}", ADD_META)


def test_read_module_and_custom_calls(tmp_path):
    path = tmp_path / "module_1.jit__device_forward.sm_9.0a_gpu_after_optimizations.txt"
    path.write_text(MODULE)
    module = hkm.read_module(path)
    fusion = module["loop_add_fusion_3"]                        # CUPTI's name: dots and dashes become "_"
    assert (fusion.detail, fusion.shape, fusion.source) == ("kLoop", "f32[64,8]{1,0}", "mhc.py:104")
    gemm = module["custom_call_3"]
    assert gemm.detail == "__cublas$gemm"
    assert gemm.source == "ops.py:102 linear_f32 < router"       # from the stack-frame tables, callers after "<"
    assert hkm.short_op(gemm.op_name) == "moe/dot_general"
    calls = hkm.custom_calls(module)
    assert calls == [(gemm, 2)]                                  # two identical GEMM calls, one group; no fusion
