"""Leaves: small tools with no rpcx imports beyond :mod:`rpcx.errors` (timers, pools,
receive buffers, environment and process facts, torch's import and C++ log).

Private: nothing here is part of rpcx's API. Imports nothing, so that
``rpcx._util.torch_import`` can run before anything else imports torch.
"""
