"""A vLLM general plugin (entry point `vllm.general_plugins`), run by vLLM in each of its
processes: the frontend, the engine core and the model worker.

On CPUs with AMX, vLLM's bf16 attention uses AMX tiles, which Linux only allows after a
process asks for them (`arch_prctl(ARCH_REQ_XCOMP_PERM)`). Compiled mode asks as a side
effect; eager mode does not and dies with an illegal instruction. This asks, once per
process, where AMX exists.
"""

from __future__ import annotations


def init_amx() -> None:
    import torch

    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        cpu._init_amx()
