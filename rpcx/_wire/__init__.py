"""What crosses the wire besides the transport's own framing: the codec (message
envelopes to frames and back), the world key's seals and proofs, and device routes.

Private: users and plugin authors reach these through :mod:`rpcx.transport`,
:mod:`rpcx.transport_kit` and the options.
"""
