"""What compiled graphs call at run time: the FlashOverlap P2P ops (``p2p``) and the per-rank
schedules traced into graphs (``flash_schedules``), the rows LeanGRPO keeps (``reuse``), aten
graphs run without a Python frame per op (``frameless``), and the host allocator setting the
CPU benchmarks use (``allocator``). Nothing here imports from
the rest of the package."""

__all__: list[str] = []
