"""What compiled graphs call at run time. Nothing here imports from the rest of the package.

- FlashOverlap: the P2P ops (``p2p``), the per-rank schedules traced into graphs
  (``flash_schedules``; their step tables in ``flash_steps``, the Ulysses all-to-all ones in
  ``a2a_schedules``, the data-slicing baseline in ``sliced_schedules``, what they share in
  ``slice_matmul``) and the attention rows a reduce-scatter reads (``attention_rows``);
- LeanGRPO: the rows it keeps and the autograd node of a reused forward (``reuse``), Reweight's
  per-sample gradient buffers (``accumulate``) and the ops its ``vmap`` needs (``vmap_ops``),
  aten graphs run without a Python frame per op (``frameless``);
- shared by passes and runtime: the fake value an fx node was traced with (``fx_values``) and
  the communication op namespaces (``namespaces``);
- the host allocator setting the CPU benchmarks use (``allocator``)."""

__all__: list[str] = []
