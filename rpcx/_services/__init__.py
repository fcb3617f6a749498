"""Services that run over the agent: calls to another worker's functions, and the RRef
lifetime protocol. (:mod:`rpcx.rref`, :mod:`rpcx.autograd` are the public ones.)

Private.
"""
