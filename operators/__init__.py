"""flowrec operators: the compute behind the planner's op kinds. Depends on torch alone (never on flowrec).

Modules: `casting` (tensor-casting index, computed ahead of time; on the CPU by the numba kernel of
`casting_cpu`), `embedding` (packed embedding
bag with a casted backward and fused sparse optimizers), `sparse_optim` (the fused optimizers),
`fused_sparse_cpu` (their numba CPU kernels: gather-reduce and update in one pass), `interaction`
(dense operators), `registry` (op kind -> operator class), `cupy_kernels` (CUDA kernels), `device`
(the one module with streams, events, pinned buffers and launches), `nvrtc` (compile checks of the
kernels without a GPU), `layout` (the packed-table layout records operators read).
"""
