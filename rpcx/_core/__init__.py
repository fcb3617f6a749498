"""The agent and the parts it is a facade over: joining, the call path, peer health,
the executors, shutdown, and the optional policies (back-pressure, retransmission,
tracing). See docs/design/architecture.md.

Private: services see the agent through :class:`rpcx._core.service_host.ServiceHost`.
"""
