"""The platform class SGLang instantiates when lockstep_cpu is activated."""
from __future__ import annotations

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform


class LockstepCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU device operations (SGLang's own mixin) behind the generic platform interface.

    _enum is OOT, not CPU: the CPU enum routes layers to sgl-kernel's AMX ops.
    Capabilities stay at the conservative defaults (no Triton, no graph capture):
    the server runs eagerly with --disable-cuda-graph.
    """

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        # torch_native: SDPA per request on the paged KV cache; no Triton, no
        # flashinfer. Lockstep passes --attention-backend explicitly too.
        return "torch_native"

    def is_pin_memory_available(self, device=None) -> bool:
        # Nothing to pin host memory for: there is no device to copy to.
        return False
