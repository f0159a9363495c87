"""Device ops of mtpserve: Triton kernels, their pure-torch reference twins, the PDL gate.

Takes tensors and plain numbers only; imports no other package of ours. The model calls every op
through `kernels.ops`, which picks the Triton kernel on a GPU and the reference twin elsewhere (or
everywhere, when `MTPSERVE_FORCE_REFERENCE=1`).
"""
