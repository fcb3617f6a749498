"""rpcx's threads run torch operators with the process's intra-op thread count.

``torch.set_num_threads(n)`` sets OpenMP's thread count on the calling thread and records
``n`` for the process. Any other thread takes ``n`` up only at its first parallel call
(torch initialises each thread's OpenMP setting lazily, once), and an operator that goes
to OpenMP without one (MKL's matrix products do) uses OpenMP's default before that: every
core, or ``OMP_NUM_THREADS``. The threads torch starts itself initialise at their start;
a plain Python thread does not. rpcx's receiving and pool threads run handlers and
backward passes, so each adopts the setting when it serves its first request (a pool
thread when it starts: pool threads start when there is work). As with torch's own
threads, a thread takes the setting once: call ``torch.set_num_threads`` before the
first call is served (before ``init_rpc`` is simplest).

Measured on the example RNN (``examples/rnn``; a trainer and a parameter server, two
cores, ``torch.set_num_threads(1)`` in each process, ``OMP_NUM_THREADS`` unset): the
backward pass took 4.3-6.2 ms per iteration on auto, the whole iteration 8.0-10.6 ms;
adopting the setting, 2.0-2.4 ms and 4.7-5.7 ms (torch: 1.8-2.3 ms and 5.5-7.2 ms).
"""

from __future__ import annotations

import torch

__all__ = ["adopt_intra_op_threads"]


def adopt_intra_op_threads() -> None:
    """Give the calling thread the process's intra-op thread count (once per thread;
    later calls cost a fraction of a microsecond)."""
    torch.get_num_threads()  # (its first call on a thread initialises the thread's count)
