"""flowrec operators: the compute behind the op kinds of `flowrec.graph.types.OP_KINDS`.

Modules: `casting` (tensor-casting index, computed ahead of time), `embedding` (packed embedding
bag with a casted backward and fused sparse optimizers), `sparse_optim` (the fused optimizers),
`interaction` (dense operators), `registry` (op kind -> operator class), `cupy_kernels` (CUDA
kernels), `device` (the one module with streams, events, pinned buffers and launches), `nvrtc`
(compile checks of the kernels without a GPU).
"""
