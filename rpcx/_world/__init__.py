"""Finding the other workers: the bounded rendezvous store, barriers and exchanges,
dynamic worlds' bookkeeping, the roster and its membership events.

Private: backends reach the store through :mod:`rpcx.transport_kit`.
"""
